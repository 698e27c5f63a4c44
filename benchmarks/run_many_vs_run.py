"""Every distinct planner candidate of a model family run for 2 steps: one launch per plan
(`heterog.run`, as the every-candidate test did) against one launch for all of them
(`run_many`), back to back in the same minutes so that the machine's load hits both alike.

    .venv/bin/python benchmarks/run_many_vs_run.py cnn gpt2 --out benchmarks/results/run_many_vs_run.json

The families and their planner settings are those of tests/test_every_candidate_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_every_candidate_runs import distinct_candidates  # noqa: E402

from heterog.ir.run_request import (  # noqa: E402
    Limits,
    LinkConfig,
    PredictionConfig,
    RunOptions,
    TimingConfig,
)
from heterog.jsonio import write_atomic  # noqa: E402
from heterog.runs import run, run_many  # noqa: E402

OPTIONS = RunOptions(
    steps=2,
    prediction=PredictionConfig(predict=False),
    limits=Limits(timeout_s=60),
    timing=TimingConfig(warmup_steps=0),
)


def one_family(family: str) -> dict:
    t0 = time.perf_counter()
    candidates = distinct_candidates(family)
    plans = [plan for _, plan in candidates]
    planned_s = time.perf_counter() - t0
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    each_failed = []
    for names, plan in candidates:
        try:
            run(plan, OPTIONS, links=LinkConfig(shape=False))
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            each_failed.append(f"{names[0]}: {type(e).__name__}")
    each_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outcomes = run_many(plans, OPTIONS)
    many_s = time.perf_counter() - t0
    return {
        "family": family,
        "distinct_plans": len(plans),
        "planning_s": round(planned_s, 1),
        "run_each_s": round(each_s, 1),
        "run_many_s": round(many_s, 1),
        "speedup": round(each_s / many_s, 2),
        "run_each_failed": each_failed,
        "run_many_failed": [o.strategy for o in outcomes if not o.ok],
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for family in args.families:
        rows.append(one_family(family))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_atomic(args.out, json.dumps({"machine": f"{os.cpu_count()} CPUs, shared", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
