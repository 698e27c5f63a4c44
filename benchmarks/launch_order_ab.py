"""A/B of a Program's collective launch order: heterog's plan for one scenario, lowered as
the Programs are now (each collective launched right after the member's own last input,
lower/lowering.py `_launch_when_ready`) and in the earlier order (the list
scheduler's global order projected on each device), measured interleaved in one launch with
the scenario's fastest single-device plan as a control for the host's speed.

Why: when a language model's data-parallel plans run well over their prediction, either the
host is slower than at its profile, or an all-reduce launched early shares the rank's one core
with the backward it overlaps (gloo reduces on the CPU).
Both orders run the same plan and are predicted alike, so their ratio, taken side by side,
separates the two; the control's error says how far the host has drifted from its profile.

    python benchmarks/launch_order_ab.py [--scenario lm-slow-far] [--repetitions 4]

Prints a table and writes benchmarks/results/launch_order_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import heterog.lower.lowering as lowering  # noqa: E402
import heterog.runs.api as api  # noqa: E402
from heterog import demo as D  # noqa: E402
from heterog.cli.output import print_table  # noqa: E402
from heterog.errors import HeterogWarning  # noqa: E402
from heterog.fmt import human_time  # noqa: E402
from heterog.ir.run_request import Limits, PredictionConfig, RunOptions, TimingConfig  # noqa: E402
from heterog.jsonio import write_atomic  # noqa: E402


def lowered_in_old_order(index: int):
    """runs.api._prepare, lowering plan `index` without moving collectives up (the old order)."""
    prepare, launch_when_ready = api._prepare, lowering._launch_when_ready

    def wrapped(plan, i, *args, **kwargs):
        lowering._launch_when_ready = (lambda *_: None) if i == index else launch_when_ready
        try:
            return prepare(plan, i, *args, **kwargs)
        finally:
            lowering._launch_when_ready = launch_when_ready

    return wrapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="lm-slow-far", choices=sorted(D.SCENARIOS))
    ap.add_argument("--repetitions", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch_order_ab.json"))
    args = ap.parse_args()
    from heterog.plan_module import search

    sc = D.SCENARIOS[args.scenario]
    cluster = sc.cluster()
    t0, load_before = time.perf_counter(), os.getloadavg()
    setup = D.prepare(
        cluster=cluster,
        model=sc.model,
        model_args=sc.model_args,
        batch_size=sc.batch_size,
        seq_len=sc.seq_len,
        profile=True,
        say=print,
    )
    result = search(setup.inputs, setup.spec, budget_s=5.0)
    single = min(
        (c for c in result.candidates if c.feasible and len(c.plan.devices()) == 1), key=lambda c: c.iteration_time_s
    )
    runs = {"new order": result.best, "old order": result.best, f"control: {single.strategy}": single.plan}
    api._prepare = lowered_in_old_order(1)
    options = RunOptions(
        steps=args.steps,
        timing=TimingConfig(repetitions=args.repetitions),
        prediction=PredictionConfig(),  # the schedule's simulation: the same in either order
        limits=Limits(timeout_s=120.0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeterogWarning)
        got = api.run_interleaved([D.runnable(setup, p) for p in runs.values()], options, inputs=setup.inputs)
    rows, doc = (
        [],
        {
            "scenario": sc.name,
            "heterog_strategy": result.best.strategy,
            "runs": {},
            "command": "python benchmarks/launch_order_ab.py " + " ".join(sys.argv[1:]),
        },
    )
    for label, r in zip(runs, got):
        if not r.ok:
            raise SystemExit(f"{label} failed to run: {r.failure}")
        times = list(r.repetitions_s)
        predicted = r.predicted_iteration_time_s
        median = statistics.median(times)
        doc["runs"][label] = {
            "predicted_iteration_time_s": predicted,
            "measured_iteration_time_s": median,
            "repetitions_s": times,
            "relative_error": (median - predicted) / predicted,
            "sync_s": [p.sync_s for p in r.per_rank],
        }
        rows.append(
            [
                label,
                human_time(predicted),
                human_time(median),
                f"{max(times) / min(times) - 1:.0%}",
                f"{(median - predicted) / predicted:+.1%}",
            ]
        )
    new, old = (doc["runs"][k]["repetitions_s"] for k in ("new order", "old order"))
    doc["old_over_new"] = statistics.median(o / n for o, n in zip(old, new))
    doc.update(
        load_average_before=load_before, load_average_after=os.getloadavg(), wall_time_s=time.perf_counter() - t0
    )
    print_table(
        f"{sc.name}: heterog's plan ({result.best.strategy}) in both launch orders, interleaved",
        ["run", "predicted", "measured (median)", "spread", "error"],
        rows,
    )
    print(f"old order / new order, median of the per-repetition ratios: {doc['old_over_new']:.3f}")
    write_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
