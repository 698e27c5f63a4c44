"""Size and time of `heterog report` (target: under 2 MB and under 5 s for a 64-device plan).

Cases: bert-large on paper-8gpu (8 devices) and gpt2 on mixed-64 (64 devices), each planned
by `heterog plan --json` (budget 5 s, seed 0) and reported from that output, timed as the
command runs it (load = capture + cost model, simulate, render + write), and again with the
graph read from a file (`--graph`, no capture); and scale-1024
with simulator_speed's synthetic 1000-node graph and its pipe-dp plan (rendering only). Times
are wall-clock on a shared 2-core machine.

    .venv/bin/python benchmarks/report_size.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

from heterog.jsonio import write_atomic

CASES = (("bert-large", 32, 128, "paper-8gpu"), ("gpt2", 256, 512, "mixed-64"))


def planned_case(model: str, batch: int, seq_len: int, cluster: str, folder: Path) -> dict:
    from heterog.cli.report_cmd import write_report
    from heterog.search.planner import plan

    t0 = time.perf_counter()
    result = plan(model, batch_size=batch, seq_len=seq_len, cluster=cluster, budget_s=5.0, seed=0, policy=False)
    plan_s = time.perf_counter() - t0
    src = folder / f"{model}-{cluster}.json"
    src.write_text(json.dumps(result))
    summary = write_report(src, folder / f"{model}-{cluster}.html")
    # the same with the graph from a file (`heterog report --graph`): no re-capture
    from heterog.capture import capture_model
    graph = folder / f"{model}.graph.json"
    capture_model(model, batch_size=batch, seq_len=seq_len).save(graph)
    with_graph = write_report(src, folder / f"{model}-{cluster}-g.html", graph=graph)
    return {"model": model, "batch_size": batch, "seq_len": seq_len, "cluster": cluster, "plan_s": plan_s,
            **{k: v for k, v in summary.items() if k != "out"},
            "with_graph_file": {k: v for k, v in with_graph.items() if k.endswith("_s")}}


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
    return {"model": "synthetic-1000-nodes", "cluster": "scale-1024", "plan": name, "devices": len(cluster.devices),
            "bytes": len(html.encode()), "simulate_s": t1 - t0, "render_s": t2 - t1}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = [planned_case(*c, folder) for c in CASES]
        rows.append(synthetic_1024(folder))
    for r in rows:
        print(json.dumps(r))
    out = Path(__file__).parent / "results" / "report_size.json"
    write_atomic(out, json.dumps({"command": "python benchmarks/report_size.py", "cases": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
