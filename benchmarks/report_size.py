"""Size and time of `heterog report`, and how fast whole commands start.

report_size.json — in one process: bert-large on paper-8gpu (8 devices) and gpt2 on mixed-64
(64 devices), each planned (budget 5 s, seed 0) and reported from the planner's output, timed
as the command runs it (load = graph + cluster + cost model, simulate, render + write); and
scale-1024 with simulator_speed's synthetic 1000-node graph and its pipe-dp plan (rendering
only). Page target: under 2 MB for 64 devices.

command_times.json — whole commands, each in a fresh process, as a user runs them:
`heterog models`; `heterog plan`, `heterog report` and `heterog simulate` of a 64-device
bert-large plan (batch 64, sequence 128, mixed-64). "cold": an empty cache folder
(HETEROG_CACHE_DIR), so the model is captured (and, for plan, exported) again; "warm": the
graph is in the cache. Targets: report under 3 s warm, models under 1 s. Wall-clock medians
on a shared 2-core machine.

    .venv/bin/python benchmarks/report_size.py [--commands-only]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from heterog.jsonio import write_atomic

CASES = (("bert-large", 32, 128, "paper-8gpu"), ("gpt2", 256, 512, "mixed-64"))


def planned_case(model: str, batch: int, seq_len: int, cluster: str, folder: Path) -> dict:
    from heterog.cli.report_cmd import write_report
    from heterog.plan_module import plan

    t0 = time.perf_counter()
    result = plan(model, batch_size=batch, seq_len=seq_len, cluster=cluster, budget_s=5.0, seed=0, policy=False)
    plan_s = time.perf_counter() - t0
    src = folder / f"{model}-{cluster}.json"
    src.write_text(json.dumps(result))
    summary = write_report(src, folder / f"{model}-{cluster}.html")
    return {
        "model": model,
        "batch_size": batch,
        "seq_len": seq_len,
        "cluster": cluster,
        "plan_s": plan_s,
        **{k: v for k, v in summary.items() if k != "out"},
    }


def synthetic_1024(folder: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from simulator_speed import make_plans, synthetic_graph

    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.report import ReportInputs, build_report
    from heterog.simulate import simulate

    cluster = load_cluster("scale-1024")
    graph = synthetic_graph(4096)
    plans = make_plans(graph, cluster, random.Random(0))
    name, p = "pipe-dp", plans["pipe-dp"]
    costs = build_cost_model(graph, cluster)
    t0 = time.perf_counter()
    sim = simulate(graph, cluster, p, costs)
    t1 = time.perf_counter()
    html = build_report(ReportInputs(plan=p, sim=sim, cluster=cluster))
    t2 = time.perf_counter()
    (folder / "scale-1024.html").write_text(html)
    return {
        "model": "synthetic-1000-nodes",
        "cluster": "scale-1024",
        "plan": name,
        "devices": len(cluster.devices),
        "bytes": len(html.encode()),
        "simulate_s": t1 - t0,
        "render_s": t2 - t1,
    }


REPEATS = 3
BIG = ("--model", "bert-large", "--batch-size", "64", "--seq-len", "128", "--cluster", "mixed-64")


def timed(args: list[str], cache: Path, cwd: Path) -> tuple[float, str]:
    """Wall time of one command in a fresh process, and its stdout."""
    env = {**os.environ, "HETEROG_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "heterog.cli.main", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    )
    return time.perf_counter() - t0, out.stdout


def command_times(folder: Path) -> dict:
    warm = folder / "cache-warm"
    cold = iter(folder / f"cache-cold-{i}" for i in range(100))
    rows = []
    timed(["models"], warm, folder)  # warm-up: the interpreter's own files in the page cache
    rows.append(
        {
            "command": "heterog models",
            "what": "list the zoo",
            "cold_s": None,
            "warm_s": statistics.median(timed(["models"], warm, folder)[0] for _ in range(5)),
        }
    )
    plan_args = ["plan", *BIG, "--budget-s", "5", "--seed", "0", "--no-gnn", "--json"]
    plan_cold, text = timed(plan_args, next(cold), folder)
    (folder / "bert64.json").write_text(text)
    timed(plan_args, warm, folder)  # fills the warm cache (graph and cuts)
    plan_warm, text = timed(plan_args, warm, folder)
    doc = json.loads(text)
    rows.append(
        {
            "command": "heterog plan ... --budget-s 5",
            "what": "plan bert-large (batch 64, seq 128) on mixed-64",
            "cold_s": plan_cold,
            "warm_s": plan_warm,
            "search_s": doc["search_time_s"],
            "other_s": doc["other_time_s"],
        }
    )
    for cmd, what in (
        (["report", "bert64.json", "--out", "r.html"], "report of that 64-device plan"),
        (["simulate", "bert64.json"], "simulate it"),
    ):
        rows.append(
            {
                "command": "heterog " + " ".join(cmd[:2]),
                "what": what,
                "cold_s": statistics.median(timed(cmd, next(cold), folder)[0] for _ in range(REPEATS)),
                "warm_s": statistics.median(timed(cmd, warm, folder)[0] for _ in range(REPEATS)),
            }
        )
    return {
        "command": "python benchmarks/report_size.py",
        "repeats": REPEATS,
        "cpu_count": os.cpu_count(),
        "load_average_before": list(os.getloadavg()),
        "rows": rows,
    }


def main() -> None:
    results = Path(__file__).parent / "results"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        times = command_times(folder)
        print(json.dumps(times, indent=1))
        write_atomic(results / "command_times.json", json.dumps(times, indent=1) + "\n")
        if "--commands-only" in sys.argv:
            return
        rows = [planned_case(*c, folder) for c in CASES]
        rows.append(synthetic_1024(folder))
    for r in rows:
        print(json.dumps(r))
    out = results / "report_size.json"
    write_atomic(out, json.dumps({"command": "python benchmarks/report_size.py", "cases": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
