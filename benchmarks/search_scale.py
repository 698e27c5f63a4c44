"""Search at scale: the best plan against the budget, from 16 to 4096 devices.

For each cluster size (mixed-16 and mixed-64, then 256, 1024 and 4096 GPUs of four types:
benchmarks/clusters/scale-256.yaml, the built-in scale-1024, benchmarks/clusters/scale-4096.yaml),
each model (ResNet-50, BERT-large, GPT-2 XL, a Llama-7B), each seed and each budget, the whole
`heterog plan` — graph from the cache, costs, baselines, bound, search — runs in this process,
timed from the call: the best plan, the best baseline, the lower bound, where the time went.
Each model's graph and what the executor can cut of it are found once, before any run (the
caches then answer, as they do a user who plans the same model twice).

    python benchmarks/search_scale.py            # the full grid: 5 sizes × 4 models × 3 seeds × 7 budgets (hours)
    python benchmarks/search_scale.py --quick    # 16, 64, 1024 devices, two models, two seeds; a few more
    python benchmarks/search_scale.py --sizes 1024 --models bert-large --budgets 15,60 --seeds 0 --merge

Writes benchmarks/results/search_scale.json (atomically) and prints a table. The figures depend
on the machine's load: the budget bounds wall-clock time, so a loaded machine searches less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("COLUMNS", "200")

from heterog.capture.cache import capture_cached  # noqa: E402
from heterog.cli.output import print_table, write_json  # noqa: E402
from heterog.errors import InfeasibleError  # noqa: E402
from heterog.ir.plan import ModelSpec  # noqa: E402
from heterog.plan_module import plan  # noqa: E402
from heterog.search.baselines import BASELINES  # noqa: E402
from heterog.search.constraints import DEFAULT_CACHE  # noqa: E402

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "search_scale.json"
CLUSTERS = {
    16: "mixed-16",
    64: "mixed-64",
    256: str(HERE / "clusters" / "scale-256.yaml"),
    1024: "scale-1024",
    4096: str(HERE / "clusters" / "scale-4096.yaml"),
}
LLAMA_7B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "ffn": 11008, "vocab": 32000}
# name → (zoo model, its arguments, sequence length, samples per device of the global batch)
MODELS = {
    "resnet50": ("resnet50", {}, None, 2.0),
    "bert-large": ("bert-large", {}, 128, 1.0),
    "gpt2-xl": ("gpt2-xl", {}, 512, 0.5),
    "llama-7b": ("llama", LLAMA_7B, 512, 0.5),
}
BUDGETS_S = (1, 3, 5, 15, 30, 60, 120)
SEEDS = (0, 1, 2)
QUICK = {"sizes": (16, 64, 1024), "models": ("resnet50", "bert-large"), "budgets": (1, 5, 15, 30), "seeds": (0, 1)}
QUICK_LARGE = [
    *[(1024, m, b, 0) for m in ("gpt2-xl", "llama-7b") for b in (15, 30)],
    (4096, "resnet50", 15, 0),
    (4096, "resnet50", 60, 0),
]


def batch_of(devices: int, model: str) -> int:
    return max(8, int(devices * MODELS[model][3]))


def run_case(devices: int, model: str, budget_s: float, seed: int) -> dict:
    name, args, seq, _ = MODELS[model]
    batch = batch_of(devices, model)
    row = {"devices": devices, "model": model, "batch_size": batch, "seq_len": seq, "budget_s": budget_s, "seed": seed}
    t = time.perf_counter()
    try:
        out = plan(
            name,
            model_args=args,
            batch_size=batch,
            seq_len=seq,
            cluster=CLUSTERS[devices],
            budget_s=budget_s,
            seed=seed,
            tolerance=0.0,  # the search's own best: the simpler-plan rule would blur the monotone check
        )
    except InfeasibleError as e:
        return {**row, "feasible": False, "error": str(e).splitlines()[0], "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    times = {c["strategy"]: c["iteration_time_s"] if c["feasible"] else None for c in out["candidates"]}
    base = [v for k, v in times.items() if k in BASELINES and v is not None]
    return {
        **row,
        "feasible": True,
        "wall_s": wall,
        "over_budget_s": wall - budget_s,
        "best": out["best"]["strategy"],
        "best_time_s": out["best"]["predicted_iteration_time_s"],
        "best_baseline_s": min(base, default=None),
        "bound_s": out["bound"]["iteration_time_s"],
        "times_s": times,
        "time_s": out["time_s"],
        "budget_split": out["budget_split"],
        "lanes": {k: {"moves": v["moves"], "new_bests": len(v["new_bests"])} for k, v in out["lanes"].items()},
    }


def summarise(rows: list[dict]) -> dict:
    """What the search promises: monotone in the budget per seed, the wall time against the budget,
    the 15-s plan against the best any budget found at 1024, and 4096 against its baselines."""
    ok = [r for r in rows if r["feasible"]]
    series: dict[tuple, list[dict]] = {}
    for r in ok:
        series.setdefault((r["devices"], r["model"], r["seed"]), []).append(r)
    worse = []
    for key, rs in series.items():
        rs.sort(key=lambda r: r["budget_s"])
        for a, b in zip(rs, rs[1:]):
            if b["best_time_s"] > a["best_time_s"] * (1 + 1e-9):
                worse.append({"case": list(key), "budgets_s": [a["budget_s"], b["budget_s"]]})
    over: dict[int, float] = {}
    for r in ok:
        over[r["devices"]] = max(over.get(r["devices"], -1e9), r["over_budget_s"])
    at_1024 = {}
    for model in {r["model"] for r in ok if r["devices"] == 1024}:
        gaps = []
        for seed in {r["seed"] for r in ok if r["devices"] == 1024 and r["model"] == model}:
            rs = series.get((1024, model, seed), [])
            at15 = [r["best_time_s"] for r in rs if r["budget_s"] == 15]
            if at15 and len(rs) > 1:
                gaps.append(at15[0] / min(r["best_time_s"] for r in rs) - 1)
        if gaps:
            at_1024[model] = statistics.median(gaps)
    at_4096 = {
        f"{r['model']} {r['budget_s']:g} s seed {r['seed']}": r["best_time_s"] < r["best_baseline_s"]
        for r in ok
        if r["devices"] == 4096 and r["best_baseline_s"] is not None
    }
    return {
        "runs": len(rows),
        "infeasible": len(rows) - len(ok),
        "larger_budget_worse": worse,
        "max_over_budget_s": over,
        "at_1024_15s_above_best_median": at_1024,
        "at_4096_beats_every_baseline": at_4096,
    }


def _grid(args) -> list[tuple[int, str, float, int]]:
    if args.quick:
        q = QUICK
        grid = [(d, m, b, s) for d in q["sizes"] for m in q["models"] for s in q["seeds"] for b in q["budgets"]]
        return grid + QUICK_LARGE
    sizes = [int(x) for x in args.sizes.split(",")]
    models = args.models.split(",")
    budgets = [float(x) for x in args.budgets.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    return [(d, m, b, s) for d in sizes for m in models for s in seeds for b in budgets]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the subset that fits in about 15 minutes on 2 cores")
    ap.add_argument("--sizes", default=",".join(map(str, CLUSTERS)), help="cluster sizes, comma-separated")
    ap.add_argument("--models", default=",".join(MODELS), help="models, comma-separated")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS_S)), help="budgets in seconds, comma-separated")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds, comma-separated")
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    ap.add_argument("--merge", action="store_true", help="keep --out's other runs; these replace equal cases")
    args = ap.parse_args(argv)
    grid = _grid(args)
    for devices, model in dict.fromkeys((d, m) for d, m, _, _ in grid):  # once, outside the runs
        name, margs, seq, _ = MODELS[model]
        t = time.perf_counter()
        capture_cached(name, margs, batch_size=batch_of(devices, model), seq_len=seq)
        DEFAULT_CACHE.get(ModelSpec(name=name, args=margs, batch_size=batch_of(devices, model), seq_len=seq))
        print(
            f"graph and cuts of {model} at batch {batch_of(devices, model)}: {time.perf_counter() - t:.1f} s",
            file=sys.stderr,
        )
    run_case(16, "resnet50", 1, 0)  # warm-up: imports and the simulator's compiled code, once per process
    rows = []
    begin = time.perf_counter()
    for devices, model, budget, seed in grid:
        r = run_case(devices, model, budget, seed)
        rows.append(r)
        best = f"{r['best_time_s'] * 1e3:.2f} ms ({r['best']})" if r["feasible"] else "infeasible"
        print(
            f"{devices:5d} {model:10s} seed {seed} budget {budget:5g} s: {best}, wall {r['wall_s']:.1f} s",
            file=sys.stderr,
        )
    command = "python benchmarks/search_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [command.strip()]
    if args.merge and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        done = {_case(r) for r in rows}
        rows = [r for r in old["rows"] if _case(r) not in done] + rows
        commands = [old["command"], *commands]
    summary = {**summarise(rows), "total_time_s": time.perf_counter() - begin, "load_average": os.getloadavg()}
    table = []
    for (devices, model), rs in _by_case(rows).items():
        by_budget = {}
        for r in rs:
            if r["feasible"]:
                by_budget.setdefault(r["budget_s"], []).append(r["best_time_s"])
        base = [r["best_baseline_s"] for r in rs if r["feasible"] and r["best_baseline_s"]]
        table.append(
            [devices, model]
            + [f"{statistics.median(v) * 1e3:.2f}" for _, v in sorted(by_budget.items())]
            + [f"{statistics.median(base) * 1e3:.2f}" if base else "—"]
        )
    print_table(
        "best plan (ms, median over seeds) by budget", ["devices", "model", "…by budget", "best baseline"], table
    )
    print(summary, file=sys.stderr)
    doc = {
        "benchmark": "search_scale",
        "command": " + ".join(commands),
        "machine": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "summary": summary,
        "rows": rows,
    }
    write_json(args.out, doc)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _case(r: dict) -> tuple:
    return (r["devices"], r["model"], r["budget_s"], r["seed"])


def _by_case(rows: list[dict]) -> dict[tuple[int, str], list[dict]]:
    out: dict[tuple[int, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["devices"], r["model"]), []).append(r)
    return out


if __name__ == "__main__":
    sys.exit(main())
