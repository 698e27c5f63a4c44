"""`heterog demo` several times in a row: do its speedups hold from run to run?

    .venv/bin/python benchmarks/demo_repeat.py [--runs 5] [--scenario NAME] [--out FILE]

Each run is a fresh `heterog demo --json` (profile, plan, then heterog's plan, the best
baseline and even data parallelism measured interleaved in one launch). Per run: heterog's
plan, predicted and measured times, and the median and worst-repetition speedups over the
best baseline and over even data parallelism. Target: the speedups of five runs
in a row within ±10 % of their mean. Writes benchmarks/results/demo_five_runs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from heterog.cli.output import print_table  # noqa: E402
from heterog.fmt import human_time  # noqa: E402
from heterog.jsonio import write_atomic  # noqa: E402

TOLERANCE = 0.10


def one_run(index: int, scenario: str | None) -> dict[str, Any]:
    cmd = [str(ROOT / ".venv" / "bin" / "heterog"), "demo", "--json"] + (["--scenario", scenario] if scenario else [])
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"run {index}: `{' '.join(cmd)}` failed ({out.returncode}): {out.stderr[-2000:]}")
    d = json.loads(out.stdout)
    s = d["strategies"]
    even = s.get("even-dp")
    return {
        "run": index,
        "started_unix_s": t0,
        "load_average_after": os.getloadavg(),
        "heterog_strategy": s["heterog"]["strategy"],
        "heterog_placement": s["heterog"]["placement"],
        "heterog_predicted_s": s["heterog"]["predicted_iteration_time_s"],
        "heterog_measured_s": s["heterog"]["measured_iteration_time_s"],
        "heterog_repetitions_s": s["heterog"]["repetitions_s"],
        "heterog_notes": d["best_plan_notes"],
        "best_baseline": s["best-baseline"]["strategy"],
        "best_baseline_predicted_s": s["best-baseline"]["predicted_iteration_time_s"],
        "best_baseline_measured_s": s["best-baseline"]["measured_iteration_time_s"],
        "best_baseline_repetitions_s": s["best-baseline"]["repetitions_s"],
        "even_dp_measured_s": even["measured_iteration_time_s"] if even else None,
        "even_dp_repetitions_s": even["repetitions_s"] if even else None,
        "speedup_vs_even_dp": d["speedup_vs_even_dp"],
        "speedup_vs_best_baseline": d["speedup_vs_best_baseline"],
        "links_measured": d["links_measured"],
        "demo_time_s": d["demo_time_s"],
    }


def deviation(values: list[float]) -> dict[str, float]:
    """The lowest and highest value relative to the mean (−0.05: 5 % below it)."""
    mean = statistics.fmean(values)
    return {"mean": mean, "low": min(values) / mean - 1.0, "high": max(values) / mean - 1.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--scenario", default=None, help="a scenario of heterog.demo.SCENARIOS (default: the demo's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo_five_runs.json"))
    args = ap.parse_args()
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(one_run(i, args.scenario))
        r = runs[-1]
        print(
            f"run {i}: heterog {human_time(r['heterog_measured_s'])}, {r['best_baseline']} "
            f"{human_time(r['best_baseline_measured_s'])}, speedup {r['speedup_vs_best_baseline']['median']:.2f}× "
            f"over the best baseline ({r['demo_time_s']:.0f} s)",
            flush=True,
        )
    summary: dict[str, Any] = {}
    for key in ("speedup_vs_best_baseline", "speedup_vs_even_dp"):
        medians = [r[key]["median"] for r in runs if r[key]]
        if medians:
            dev = deviation(medians)
            summary[key] = {
                **dev,
                "within_tolerance": -TOLERANCE <= dev["low"] and dev["high"] <= TOLERANCE,
                "worst_repetition_min": min(r[key]["worst"] for r in runs if r[key]),
            }
    print_table(
        f"heterog demo, {args.runs} runs in a row",
        [
            "run",
            "heterog: predicted / measured",
            "best baseline",
            "vs best: median (worst)",
            "vs even DP: median (worst)",
        ],
        [
            [
                str(r["run"]),
                f"{r['heterog_strategy']} {human_time(r['heterog_predicted_s'])} / "
                f"{human_time(r['heterog_measured_s'])}",
                f"{r['best_baseline']} {human_time(r['best_baseline_measured_s'])}",
                f"{r['speedup_vs_best_baseline']['median']:.2f}× ({r['speedup_vs_best_baseline']['worst']:.2f}×)",
                (
                    f"{r['speedup_vs_even_dp']['median']:.2f}× ({r['speedup_vs_even_dp']['worst']:.2f}×)"
                    if r["speedup_vs_even_dp"]
                    else "n/a"
                ),
            ]
            for r in runs
        ],
    )
    for key, s in summary.items():
        print(
            f"{key}: mean {s['mean']:.2f}×, runs {s['low']:+.1%} to {s['high']:+.1%} of it "
            f"(target ±{TOLERANCE:.0%}: {'met' if s['within_tolerance'] else 'MISSED'})"
        )
    write_atomic(
        args.out,
        json.dumps(
            {
                "benchmark": "demo_five_runs",
                "command": "python benchmarks/demo_repeat.py " + " ".join(sys.argv[1:]),
                "cpu_count": os.cpu_count(),
                "runs": runs,
                "summary": summary,
            },
            indent=1,
        )
        + "\n",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
