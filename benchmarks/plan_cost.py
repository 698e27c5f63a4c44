"""The cost objective: the plan cheapest per sample against the fastest plan, for a CNN
(resnet50) and a transformer (bert-large) on paper-8gpu and mixed-16.

Each case is planned twice with the same seed and move cap, `objective=time` and
`objective=cost`, both with tolerance 0 (so "fastest" and "cheapest" are exactly that); the
table gives each plan's predicted iteration time and price per million samples, and the
ratios: how much slower the cheapest plan is, and how much more the fastest one costs.

Prices: the catalog's list prices (hardware/catalog.yaml, each with its page and date). A
type the catalog leaves unpriced is priced here, and only here, at the median catalog price
per peak fp32 TFLOP/s times its own fp32 peak; the output and the JSON list those assumed
prices. Relative prices decide the cost objective's choice, so read the figures as "under
these prices".

    .venv/bin/python benchmarks/plan_cost.py [--budget-s 5] [--max-iters 200]

Writes benchmarks/results/plan_cost.json (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("COLUMNS", "200")  # the table is wide; rich reads this when not on a terminal

from heterog.capture import capture_model  # noqa: E402
from heterog.cli.output import print_table, write_json  # noqa: E402
from heterog.cost import build_cost_model  # noqa: E402
from heterog.hardware.catalog import list_gpus  # noqa: E402
from heterog.hardware.cluster import Cluster  # noqa: E402
from heterog.hardware.spec import load_cluster, with_prices  # noqa: E402
from heterog.ir.plan import ModelSpec  # noqa: E402
from heterog.search.constraints import DEFAULT_CACHE  # noqa: E402
from heterog.search.objective import Goal  # noqa: E402
from heterog.search.planner import plan_graph  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "plan_cost.json"
MODELS = [("resnet50", 64, None), ("bert-large", 32, 128)]  # (model, batch, seq_len)
CLUSTERS = ["paper-8gpu", "mixed-16"]


def usd_per_fp32_tflops() -> float:
    """The median catalog list price per peak fp32 TFLOP/s, over the priced types."""
    return statistics.median(
        g.price.usd_per_hour / (g.peak_flops_per_s["fp32"] / 1e12) for g in list_gpus() if g.price is not None
    )


def priced(name: str) -> tuple[Cluster, dict[str, float]]:
    """The cluster with each unpriced type priced by the fp32 rule; the assumed prices."""
    cluster = load_cluster(name)
    rate = usd_per_fp32_tflops()
    assumed = {
        t: round(g.peak_flops_per_s["fp32"] / 1e12 * rate, 4) for t, g in cluster.gpu_types.items() if g.price is None
    }
    return (with_prices(cluster, assumed) if assumed else cluster), assumed


def summary(r) -> dict:
    best = r.best
    cost = best.predicted_cost
    return {
        "strategy": best.strategy,
        "devices_used": len(best.devices()),
        "devices": sorted({d.split("/")[0] for d in best.devices()}),
        "iteration_time_s": best.predicted_iteration_time_s,
        "usd_per_hour": cost["usd_per_hour"],
        "usd_per_million_samples": cost["usd_per_million_samples"],
        "usd_per_million_tokens": cost.get("usd_per_million_tokens"),
        "search_time_s": r.search_time_s,
        "notes": list(best.notes[:3]),
    }


def run_case(model: str, batch: int, seq_len: int | None, cluster_name: str, args) -> dict:
    spec = ModelSpec(name=model, batch_size=batch, seq_len=seq_len)
    graph = capture_model(model, None, batch_size=batch, seq_len=seq_len)
    DEFAULT_CACHE.get(spec)  # what the executor can cut, before the budget's clock
    cluster, assumed = priced(cluster_name)
    costs = build_cost_model(graph, cluster)
    row: dict = {"model": model, "batch_size": batch, "seq_len": seq_len, "cluster": cluster_name}
    row["assumed_usd_per_hour"] = assumed
    for objective in ("time", "cost"):
        r = plan_graph(
            graph,
            cluster,
            costs,
            budget_s=args.budget_s,
            seed=args.seed,
            max_iters=args.max_iters,
            model_spec=spec,
            policy=False,
            workers=1,
            goal=Goal(objective=objective, tolerance=0.0),
        )
        row["fastest" if objective == "time" else "cheapest"] = summary(r)
    f, c = row["fastest"], row["cheapest"]
    row["time_ratio"] = c["iteration_time_s"] / f["iteration_time_s"]  # the cheapest is this much slower
    row["cost_ratio"] = f["usd_per_million_samples"] / c["usd_per_million_samples"]  # the fastest costs this × more
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=5.0, help="search budget per plan")
    ap.add_argument("--max-iters", type=int, default=200, help="moves per search chain (reproducible plans)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    args = ap.parse_args(argv)
    begin = time.perf_counter()
    rows = []
    for model, batch, seq_len in MODELS:
        for cluster_name in CLUSTERS:
            t = time.perf_counter()
            rows.append(run_case(model, batch, seq_len, cluster_name, args))
            print(f"{model} on {cluster_name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    table = []
    for r in rows:
        f, c = r["fastest"], r["cheapest"]
        table.append(
            [
                f"{r['model']} ({r['batch_size']}" + (f" × {r['seq_len']})" if r["seq_len"] else ")"),
                r["cluster"],
                f"{f['strategy']} on {f['devices_used']}",
                f"{f['iteration_time_s'] * 1e3:.1f} ms",
                f"${f['usd_per_million_samples']:.2f}",
                f"{c['strategy']} on {c['devices_used']}",
                f"{c['iteration_time_s'] * 1e3:.1f} ms",
                f"${c['usd_per_million_samples']:.2f}",
                f"{r['time_ratio']:.2f}×",
                f"{r['cost_ratio']:.2f}×",
            ]
        )
    print_table(
        "cheapest per sample vs fastest (tolerance 0); $ per million samples",
        ["model", "cluster", "fastest", "time", "$/M", "cheapest", "time", "$/M", "slower", "fastest costs"],
        table,
    )
    for r in rows:
        if r["assumed_usd_per_hour"]:
            print(f"{r['cluster']}: assumed $/hour {r['assumed_usd_per_hour']} (no catalog price)", file=sys.stderr)
    write_json(
        args.out,
        {
            "command": " ".join(["benchmarks/plan_cost.py", *(argv if argv is not None else sys.argv[1:])]),
            "budget_s": args.budget_s,
            "max_iters": args.max_iters,
            "seed": args.seed,
            "usd_per_fp32_tflops": usd_per_fp32_tflops(),
            "machine": platform.node(),
            "elapsed_s": time.perf_counter() - begin,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
