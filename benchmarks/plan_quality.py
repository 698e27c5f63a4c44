"""Plan quality: simulated iteration time of every candidate strategy, per model and cluster.

For the paper's eight models (typical batch sizes) on paper-8gpu, mixed-16 and mixed-64, plus
cases too large for plain data parallelism on the smallest GPU, and one scale-1024 case for
search time: the simulated time of each baseline, the search alone, the GNN alone and both,
the speedup of the best over even data parallelism (ring all-reduce), and the search time.
The language models people fine-tune with sharded state (gpt2-xl, tinyllama-1.1b, llama-7b;
AdamW; fp16, which every GPU of the built-in clusters runs on tensor cores, and llama-7b also
in amp-bf16 on mixed-16) are compared with the sharded baselines fsdp-even and zero-uneven
too, and with megatron-3d (the best uniform tp × pp × dp grid plan the planner scores within
its budget, search/tp_moves.py), where heterog's search may split groups by tensor
parallelism; the summary gives the geometric-mean gain over the best baseline on them.
`--only lm` runs just them and keeps the other rows of the results file.

    .venv/bin/python benchmarks/plan_quality.py [--budget-s 6] [--quick] [--only lm]

Writes benchmarks/results/plan_quality.json (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("COLUMNS", "250")  # the table is wide; rich reads this when not on a terminal

from heterog.capture import capture_model  # noqa: E402
from heterog.cli.output import print_table, write_json  # noqa: E402
from heterog.cost import build_cost_model  # noqa: E402
from heterog.errors import InfeasibleError  # noqa: E402
from heterog.hardware.spec import load_cluster  # noqa: E402
from heterog.ir.plan import ModelSpec  # noqa: E402
from heterog.search.baselines import BASELINE_BUILDERS  # noqa: E402
from heterog.search.constraints import DEFAULT_CACHE  # noqa: E402
from heterog.search.objective import Goal  # noqa: E402
from heterog.search.planner import CANDIDATES, plan_graph  # noqa: E402
from heterog.search.three_d import best_uniform, grid  # noqa: E402
from heterog.search.tp_moves import GRID_NAME  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "plan_quality.json"

# (model, model args, batch size, seq len): the paper's eight at batch sizes typical for each
PAPER_MODELS = [
    ("vgg19", {}, 64, None),
    ("resnet200", {}, 32, None),
    ("inception_v3", {}, 64, None),
    ("mobilenet_v2", {}, 128, None),
    ("nasnet", {}, 32, None),
    ("transformer", {}, 64, 256),
    ("bert-large", {}, 32, 384),
    ("xlnet-large", {}, 16, 512),
]
PAPER_CLUSTERS = ["paper-8gpu", "mixed-16", "mixed-64"]
# too large for plain data parallelism on the smallest GPU (GTX 1080 Ti, 11 GB) of paper-8gpu
LARGE_CASES = [
    ("bert-large", {}, 128, 384, "paper-8gpu"),
    ("xlnet-large", {}, 64, 512, "paper-8gpu"),
    ("transformer", {"layers": 24, "d_model": 1024, "heads": 16, "ffn": 4096}, 64, 256, "paper-8gpu"),
]
SCALE_CASES = [("resnet50", {}, 2048, None, "scale-1024")]
# (model, args, batch, seq, cluster, precision), trained with AdamW
LM_CASES = [
    (m, {}, 16, s, c, "fp16")
    for m, s in (("gpt2-xl", 1024), ("tinyllama-1.1b", 2048), ("llama-7b", 2048))
    for c in PAPER_CLUSTERS
] + [("llama-7b", {}, 16, 2048, "mixed-16", "amp-bf16")]
BASELINES = (*BASELINE_BUILDERS, GRID_NAME)


def _full_grid(graph, cluster, costs, spec, precision, optimizer) -> dict | None:
    """Megatron's whole uniform grid scored outside the planner's budget (as a Megatron user
    would try every configuration): the best one, to check heterog's plan against it too."""
    t = time.perf_counter()
    ranked = (
        best_uniform(graph, cluster, costs, spec, deadline_s=math.inf, precision=precision, optimizer=optimizer)
        if grid(graph, cluster, spec)
        else []
    )
    fitting = [p for p in ranked if p.feasible]
    if not fitting:
        return {"configurations": len(ranked), "best_time_s": None, "time_s": time.perf_counter() - t}
    best = fitting[0]
    return {
        "configurations": len(ranked),
        "best_time_s": best.iteration_time_s,
        "tp_pp_dp_microbatches": [best.tp, best.pp, best.dp, best.microbatches],
        "time_s": time.perf_counter() - t,
    }


def run_case(
    graph, cluster_name, spec, budget_s, seed, policy=None, precision="fp32", optimizer="sgd", full_grid=False
):
    cluster = load_cluster(cluster_name)
    costs = build_cost_model(graph, cluster, precision=precision, optimizer=optimizer)
    row = {
        "model": spec.name,
        "model_args": spec.args,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "cluster": cluster_name,
        "precision": precision,
        "optimizer": optimizer,
        "devices": len(cluster.devices),
        "budget_s": budget_s,
    }
    t = time.perf_counter()
    try:
        r = plan_graph(
            graph,
            cluster,
            costs,
            budget_s=budget_s,
            seed=seed,
            model_spec=spec,
            policy=policy,
            precision=precision,
            optimizer=optimizer,
            goal=Goal(tolerance=0.0),  # the search's own best, compared with the baselines
        )
    except InfeasibleError as e:
        row.update(feasible=False, error=str(e), search_time_s=time.perf_counter() - t)
        return row
    times = {c.strategy: (c.iteration_time_s if c.feasible else None) for c in r.candidates}
    even = times.get("even-dp-allreduce")
    baseline_best = min((v for k, v in times.items() if k in BASELINES and v is not None), default=None)
    row.update(
        feasible=True,
        times_s=times,
        best=r.best.strategy,
        best_time_s=r.best.predicted_iteration_time_s,
        speedup_vs_even_dp=(even / r.best.predicted_iteration_time_s) if even else None,
        speedup_vs_best_baseline=(baseline_best / r.best.predicted_iteration_time_s) if baseline_best else None,
        search_time_s=r.search_time_s,
        best_baseline=min(
            (k for k, v in times.items() if k in BASELINES and v is not None), key=lambda k: times[k], default=None
        ),
        sharded_groups=sum(1 for g in r.best.groups if g.shard_stage),
        tensor_parallel_groups=sum(1 for g in r.best.groups if g.tp_degree > 1),
        megatron_3d=r.budget_split.get(GRID_NAME),
        megatron_3d_full_grid=_full_grid(graph, cluster, costs, spec, precision, optimizer) if full_grid else None,
        bound_s=r.bound.iteration_time_s,
        above_bound=None if r.best.tensor_parallel else r.bound.within(r.best.predicted_iteration_time_s),
        devices_used=len(r.best.devices()),
        scored_by=r.candidates[0].scored_by,
        notes=list(r.best.notes[:2]),
    )
    return row


def _case_key(r: dict) -> str:
    return json.dumps(
        [r["model"], r["model_args"], r["batch_size"], r["seq_len"], r["cluster"], r.get("precision", "fp32")],
        sort_keys=True,
    )


def _kept(path: Path, rows: list[dict]) -> list[dict]:
    """The rows of an earlier results file for cases that `rows` does not hold."""
    if not path.exists():
        return []
    made = {_case_key(r) for r in rows}
    return [r for r in json.loads(path.read_text())["rows"] if _case_key(r) not in made]


def _command(path: Path, argv) -> str:
    """This run's command; with --only, after the command that made the rows it kept."""
    this = "python benchmarks/plan_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if "--only" not in this or not path.exists():
        return this
    before = json.loads(path.read_text()).get("command", "")
    return " + ".join(dict.fromkeys(c for c in (*before.split(" + "), this) if c))


def _lm_summary(rows: list[dict]) -> dict:
    """The language-model cases against their best baseline (megatron-3d among them): the
    geometric mean of heterog's speedup, and whether heterog was never slower than megatron-3d."""
    lm = {
        _case_key({**dict(zip(("model", "model_args", "batch_size", "seq_len", "cluster"), c)), "precision": c[5]})
        for c in LM_CASES
    }
    gains = [r["speedup_vs_best_baseline"] for r in rows if _case_key(r) in lm and r.get("speedup_vs_best_baseline")]
    feasible = [r for r in rows if _case_key(r) in lm and r.get("feasible")]
    full = [(r["best_time_s"], (r.get("megatron_3d_full_grid") or {}).get("best_time_s")) for r in feasible]
    return {
        "lm_cases": len(gains),
        "lm_geomean_gain_over_best_baseline": _geomean(gains),
        "lm_never_worse_than_megatron_3d": all(
            r["times_s"].get(GRID_NAME) is None or r["best_time_s"] <= r["times_s"][GRID_NAME] + 1e-12 for r in feasible
        ),
        # Megatron's whole grid, scored outside the budget
        "lm_never_worse_than_megatron_3d_full_grid": all(m is None or best <= m + 1e-12 for best, m in full),
        "lm_geomean_gain_over_megatron_3d_full_grid": _geomean([m / best for best, m in full if m is not None]),
    }


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _fmt(v):
    return "OOM" if v is None else f"{v * 1e3:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=6.0, help="search budget per case (≤ 64 GPUs)")
    ap.add_argument("--scale-budget-s", type=float, default=30.0, help="search budget for scale-1024")
    ap.add_argument("--quick", action="store_true", help="only paper-8gpu, no large/scale cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default=None, help="GNN policy file (default: the shipped one)")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    ap.add_argument("--only", choices=("lm",), help="run only these cases; keep the file's other rows")
    args = ap.parse_args(argv)
    cases = [(m, a, b, s, c, "fp32", "sgd") for (m, a, b, s) in PAPER_MODELS for c in PAPER_CLUSTERS]
    if args.quick:
        cases = [x for x in cases if x[4] == "paper-8gpu"]
    else:
        cases += [(*x, "fp32", "sgd") for x in LARGE_CASES + SCALE_CASES]
        cases += [(*x, "adamw") for x in LM_CASES]
    if args.only == "lm":
        cases = [(*x, "adamw") for x in LM_CASES]
    graphs: dict = {}
    rows = []
    begin = time.perf_counter()
    for m, a, b, s, c, precision, optimizer in cases:
        key = (m, json.dumps(a, sort_keys=True), b, s)
        spec = ModelSpec(name=m, args=a, batch_size=b, seq_len=s)
        if key not in graphs:  # the graph and what the executor can cut, before the budget's clock
            t = time.perf_counter()
            graphs[key] = capture_model(m, a or None, batch_size=b, seq_len=s)
            DEFAULT_CACHE.get(spec)
            print(f"captured {m} (batch {b}) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        budget = args.scale_budget_s if c == "scale-1024" else args.budget_s
        lm = (m, a, b, s, c, precision) in LM_CASES
        row = run_case(graphs[key], c, spec, budget, args.seed, args.policy, precision, optimizer, full_grid=lm)
        rows.append(row)
        print(
            f"{m:14s} {c:11s} best={row.get('best')} x{row.get('speedup_vs_even_dp') or 0:.2f} "
            f"{row['search_time_s']:.1f}s",
            file=sys.stderr,
        )
    if args.only:  # the rows of the results file this run did not make
        rows = [*_kept(Path(args.out), rows), *rows]
    cols = ["model", "batch", "cluster", "precision", *CANDIDATES, "best", "× even-dp", "× best baseline", "search s"]
    table = []
    for r in rows:
        t = r.get("times_s", {})
        label = r["model"] + (
            "" if not r["model_args"] else "(" + ",".join(f"{k}={v}" for k, v in r["model_args"].items()) + ")"
        )
        table.append(
            [
                label,
                r["batch_size"],
                r["cluster"],
                f"{r.get('precision', 'fp32')}, {r.get('optimizer', 'sgd')}",
                *[_fmt(t.get(n)) if n in t else "—" for n in CANDIDATES],
                r.get("best", "infeasible"),
                f"{r['speedup_vs_even_dp']:.2f}" if r.get("speedup_vs_even_dp") else "even-dp OOM",
                f"{r['speedup_vs_best_baseline']:.2f}" if r.get("speedup_vs_best_baseline") else "all OOM",
                f"{r['search_time_s']:.1f}",
            ]
        )
    print_table("simulated iteration time (ms) per candidate", cols, table)
    gnn_alone = [r for r in rows if r.get("times_s", {}).get("gnn")]
    summary = {
        "cases": len(rows),
        "best_never_worse_than_baselines": all(
            r["best_time_s"] <= min((v for k, v in r["times_s"].items() if v is not None), default=float("inf")) + 1e-12
            for r in rows
            if r.get("feasible")
        ),
        "gnn_alone_beats_best_baseline": sum(
            1
            for r in gnn_alone
            if r["times_s"]["gnn"] < min(v for k, v in r["times_s"].items() if k in BASELINES and v is not None) - 1e-12
            if any(k in BASELINES and v is not None for k, v in r["times_s"].items())
        ),
        "gnn_plus_search_beats_search": sum(
            1
            for r in rows
            if r.get("times_s", {}).get("gnn+search")
            and r["times_s"].get("search")
            and r["times_s"]["gnn+search"] < r["times_s"]["search"] - 1e-12
        ),
        "search_beats_gnn_plus_search": sum(
            1
            for r in rows
            if r.get("times_s", {}).get("gnn+search")
            and r["times_s"].get("search")
            and r["times_s"]["search"] < r["times_s"]["gnn+search"] - 1e-12
        ),
        "total_time_s": time.perf_counter() - begin,
        **_lm_summary(rows),
    }
    print(json.dumps(summary, indent=1))
    write_json(
        args.out,
        {
            "benchmark": "plan_quality",
            "command": _command(Path(args.out), argv),
            "machine": platform.processor() or platform.machine(),
            "summary": summary,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
