"""The lower bound's tightness on paper-8gpu's CNNs: the bound, the best plan, and the least
compute time of data parallelism, per model, with and without whole samples.

For the five CNNs of plan_quality at its batch sizes on paper-8gpu: the bound
(search/bound.py, its bisection run to the end) and the seconds it took; the best plan the
planner finds (seed 0, a 6-s budget, tolerance 0: plan_quality's setting) and how far above
the bound it is; and `dp_compute_s`, the least time any data-parallel plan spends computing
(every used device runs the whole model on its share, shares continuous, communication free:
the cost model's times under the same convex hull the bound uses), and `dp_whole_samples_s`,
the same with a whole number of samples per device and every replica stepping its whole
optimizer (search/dp_floor.py, the floor `heterog plan` prints beside the bound: at 4 samples
per device one sample more is a quarter more time). A plan near `dp_compute_s`
is near the best data parallelism can do, however far it is from the bound: then the bound,
not the plan, is what is loose (it admits splits of the groups over the devices, pipelines
without a bubble, that real pipelines do not reach). `dp_one_step_s` is `dp_compute_s` with
the optimizer stepped once in all, a part on each device, as the bound allows (sharded state
whose collectives cost nothing): between it and `dp_compute_s` lies what each replica's whole
step costs, between it and the bound what splitting the groups over the devices would gain.

    python benchmarks/bound_tightness.py                        # the bound now, and the plans
    PYTHONPATH=<an earlier heterog's src> python benchmarks/bound_tightness.py --label before --bound-only --merge \
        --about "what that bound is"

Writes benchmarks/results/bound_tightness.json (atomically; --merge keeps the rows of other
labels) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
from scipy.optimize import linprog  # noqa: E402

from heterog.capture import capture_model  # noqa: E402
from heterog.cli.output import print_table, write_json  # noqa: E402
from heterog.cost import build_cost_model  # noqa: E402
from heterog.hardware.spec import load_cluster  # noqa: E402
from heterog.ir.plan import ModelSpec  # noqa: E402
from heterog.search.bound import lower_bound  # noqa: E402
from heterog.search.call_hull import b_max, sizes, under  # noqa: E402
from heterog.search.constraints import DEFAULT_CACHE  # noqa: E402
from heterog.search.dp_floor import plain_data_parallel_s  # noqa: E402
from heterog.search.grouping import make_groups  # noqa: E402
from heterog.search.objective import Goal  # noqa: E402
from heterog.search.planner import plan_graph  # noqa: E402
from heterog.search.problem import Problem  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "bound_tightness.json"
CLUSTER = "paper-8gpu"
MODELS = [("vgg19", 64), ("resnet200", 32), ("inception_v3", 64), ("mobilenet_v2", 128), ("nasnet", 32)]
BUDGET_S = 6.0


def _whole_model(prob: Problem) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, float]]:
    """Per device class: its devices, the hull of one replica's time for the whole model
    (knots, values, edges: call_hull.under, as the bound takes it) and its whole optimizer step."""
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    asked = sizes(prob.batch_size)
    out = []
    for c, rep in enumerate(prob.class_rep):
        times = [sum(sum(table.times_s(tuple(n), rep, b)) for n in prob.groups) for b in asked]
        knots, vals, edges = under(asked, times)
        opt = sum(table.optimizer_s(tuple(n), rep) for n in prob.groups)
        out.append((int(np.sum(prob.dev_class == c)), knots, vals, edges, opt))
    return out


def _least(holds, hi: float) -> float:
    """The least T in (0, hi] where holds(T), to 0.1 % (holds is monotone)."""
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        lo, hi = (lo, (lo + hi) / 2) if holds((lo + hi) / 2) else ((lo + hi) / 2, hi)
    return hi


def dp_compute_s(per_class: list, batch: int) -> float:
    """The least T such that the devices (per class: _whole_model), each computing at most the
    samples the whole model's hull allows in T less its optimizer step, hold the batch."""

    def holds(t: float) -> bool:
        return sum(n * b_max(k, v, t - opt) for n, k, v, _, opt in per_class) >= batch

    return _least(holds, min(float(v[-1]) + opt for _, _, v, _, opt in per_class))


def dp_one_step_s(per_class: list, batch: int, hi: float) -> float:
    """dp_compute_s (hi: its value, where this holds too) with the optimizer stepped once in
    all, each device a part of it (what sharded state would do with collectives for free; the
    bound lets a plan do the same):
    per class, u devices compute x samples (q·u + m·x ≤ T·u for each hull edge (q, m)) and its
    n devices also step a part w of the optimizer within n·T; Σ x = batch, Σ w = 1 (HiGHS)."""
    n_c = len(per_class)
    a_eq = np.zeros((2, 3 * n_c))
    a_eq[0, 1::3] = 1.0  # x: samples
    a_eq[1, 2::3] = 1.0  # w: the part of the optimizer step

    def holds(t: float) -> bool:
        rows, rhs = [], []
        for c, (n, _, _, edges, opt) in enumerate(per_class):
            for q, m in edges:
                used = np.zeros(3 * n_c)
                used[3 * c : 3 * c + 2] = q - t, m  # each used device's share within t
                busy = np.zeros(3 * n_c)
                busy[3 * c : 3 * c + 3] = q, m, opt  # and the class's compute and step within n·t
                rows += [used, busy]
                rhs += [0.0, n * t]
        bounds = [b for n, *_ in per_class for b in ((0.0, float(n)), (0.0, None), (0.0, 1.0))]
        res = linprog(
            np.zeros(3 * n_c),
            A_ub=np.array(rows),
            b_ub=rhs,
            A_eq=a_eq,
            b_eq=[batch, 1.0],
            bounds=bounds,
            method="highs",
        )
        return res.status == 0

    return _least(holds, hi)


def run_model(model: str, batch: int, bound_only: bool) -> dict:
    graph = capture_model(model, None, batch_size=batch)
    spec = ModelSpec(name=model, args={}, batch_size=batch, seq_len=None)
    cuts = DEFAULT_CACHE.get(spec)
    cluster = load_cluster(CLUSTER)
    costs = build_cost_model(graph, cluster, precision="fp32", optimizer="sgd")
    prob = Problem(
        graph=graph,
        cluster=cluster,
        costs=costs,
        groups=make_groups(graph, cluster, costs, 32, cuts),
        batch_size=batch,
        model_spec=spec,
        cuts=cuts,
    )
    t = time.perf_counter()
    bound = lower_bound(prob)
    row = {
        "model": model,
        "batch_size": batch,
        "cluster": CLUSTER,
        "bound_s": bound.iteration_time_s,
        "bound_time_s": time.perf_counter() - t,
    }
    if not bound_only:
        per_class = _whole_model(prob)
        row["dp_compute_s"] = float(dp_compute_s(per_class, batch))
        row["dp_one_step_s"] = float(dp_one_step_s(per_class, batch, row["dp_compute_s"]))
        floor = plain_data_parallel_s(prob)  # no deadline: never None
        assert floor is not None
        row["dp_whole_samples_s"] = floor
        r = plan_graph(graph, cluster, costs, budget_s=BUDGET_S, seed=0, model_spec=spec, goal=Goal(tolerance=0.0))
        best = r.best.predicted_iteration_time_s
        row.update(
            best_s=best,
            best=r.best.strategy,
            above_bound=best / bound.iteration_time_s - 1,
            above_dp_compute=best / row["dp_compute_s"] - 1,
            above_dp_whole_samples=best / row["dp_whole_samples_s"] - 1,
        )
    return row


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f} %"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after", help="names this version of the bound in the rows")
    ap.add_argument("--bound-only", action="store_true", help="the bound only: no planning, no data-parallel columns")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows of other labels")
    ap.add_argument("--about", default="this tree's", help="what the label's bound is (kept in the results file)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    begin = time.perf_counter()
    rows = []
    for model, batch in MODELS:
        row = {"label": args.label, **run_model(model, batch, args.bound_only)}
        rows.append(row)
        print(f"{model}: bound {row['bound_s'] * 1e3:.2f} ms in {row['bound_time_s']:.2f} s", file=sys.stderr)
    out = Path(args.out)
    command = "python benchmarks/bound_tightness.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commands, labels = [], {}
    if args.merge and out.exists():
        old = json.loads(out.read_text())
        labels = {k: v for k, v in old.get("labels", {}).items() if k != args.label}
        rows = [r for r in old["rows"] if r["label"] != args.label] + rows
        commands = [c for c in old["command"].split(" + ") if c.strip() != command.strip()]
    best = {r["model"]: r for r in rows if "best_s" in r}
    table = []
    for r in rows:
        plan = best.get(r["model"])
        above = plan["best_s"] / r["bound_s"] - 1 if plan else None
        table.append(
            [r["label"], r["model"], r["batch_size"], f"{r['bound_s'] * 1e3:.2f}", f"{r['bound_time_s']:.2f}"]
            + [f"{plan['best_s'] * 1e3:.2f}" if plan else "—", _pct(above)]
            + [f"{r['dp_compute_s'] * 1e3:.2f}" if "dp_compute_s" in r else "—"]
            + [f"{r['dp_one_step_s'] * 1e3:.2f}" if "dp_one_step_s" in r else "—"]
            + [_pct(r["above_dp_compute"]) if "above_dp_compute" in r else "—"]
        )
    cols = [
        "bound",
        "model",
        "batch",
        "bound ms",
        "bound s",
        "best plan ms",
        "above bound",
        "dp compute ms",
        "dp one step ms",
        "above dp",
    ]
    print_table(f"the lower bound on {CLUSTER}", cols, table)
    summary = {
        "within_10_percent": {
            r["model"]: bool(best[r["model"]]["best_s"] / r["bound_s"] - 1 <= 0.10)
            for r in rows
            if r["model"] in best and r["label"] == args.label
        },
        "total_time_s": time.perf_counter() - begin,
        "load_average": os.getloadavg(),
    }
    write_json(
        out,
        {
            "benchmark": "bound_tightness",
            "command": " + ".join([*commands, command]),
            "machine": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "summary": summary,
            "labels": {**labels, args.label: args.about},
            "rows": rows,
        },
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
