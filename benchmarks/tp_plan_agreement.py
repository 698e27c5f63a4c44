"""Tensor-parallel Plans against the cost model they are priced by: AMP's measured configurations.

benchmarks/amp_iterations.py rebuilds each of AMP's 52 GPT-2 configurations on 16 T4s as
a plan on each tensor-parallel group's first rank, priced by TensorParallelCostModel over the
split graph. Here the same configurations are Plans as a user writes them: the whole graph,
each replica's other ranks in `Replica.tp_devices`, the analytic cost model of the unsplit
graph; the simulator builds the split graph and the cost model from the plan itself
(simulate/tensor_parallel.py). The table gives both predictions and their relative
difference per tensor-parallel run (tp = 1 runs have no members: the same plan both ways).

    .venv/bin/python benchmarks/tp_plan_agreement.py      # the 32 tp > 1 configurations (~20 s)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import amp_iterations as pi

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "tp_plan_agreement.json"


def with_members(plan, graph, names: list[str], tp: int):
    """The first-rank plan with every replica's next tp − 1 ranks as its members, on the whole graph."""
    at = {n: i for i, n in enumerate(names)}
    groups = tuple(
        dataclasses.replace(
            g,
            replicas=tuple(
                dataclasses.replace(r, tp_devices=tuple(names[at[r.device] + 1 : at[r.device] + tp]))
                for r in g.replicas
            ),
        )
        for g in plan.groups
    )
    return dataclasses.replace(plan, groups=groups, graph_fingerprint=graph.fingerprint())


def main() -> int:
    from heterog.hardware.spec import cluster_from_dict
    from heterog.inputs import model_inputs
    from heterog.ir.plan import ModelSpec
    from heterog.simulate.simulator import simulate

    t0 = time.perf_counter()
    data = pi.load_runs()
    spec = ModelSpec(name=pi.MODEL, batch_size=32, seq_len=1024)
    doc = dict(data["cluster"])
    doc["description"] = doc.pop("note", "")
    graph, cluster, costs = model_inputs(spec, cluster_from_dict(doc), precision="fp16", optimizer="adamw")
    names = [d.name for d in cluster.devices]
    problems, rows = {}, []
    for run in data["iterations"]:
        p = run["plan"]
        if p["tp"] == 1:
            continue
        if p["tp"] not in problems:
            tp_costs = pi.tensor_parallel_costs(graph, cluster, p["tp"])
            problems[p["tp"]] = pi.problem_for(tp_costs.graph, cluster, tp_costs, spec)
        prob, spec_groups = problems[p["tp"]]
        first = prob.to_plan(pi.plan_of(run, prob, spec_groups), "amp")
        benchmark_s = simulate(prob.graph, cluster, first, prob.costs).iteration_time_s
        plan_s = simulate(graph, cluster, with_members(first, graph, names, p["tp"]), costs).iteration_time_s
        rows.append(
            {
                "tp": p["tp"],
                "dp": p["dp"],
                "pp": p["pp"],
                "micro_batch": p["micro_batch"],
                "amp_iterations_s": benchmark_s,
                "plan_with_members_s": plan_s,
                "relative_difference": plan_s / benchmark_s - 1,
            }
        )
    print(f"{'tp':>3} {'dp':>3} {'pp':>3} {'mb':>3} {'benchmark':>10} {'plan':>10} {'diff':>8}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['dp']:>3} {r['pp']:>3} {r['micro_batch']:>3} {r['amp_iterations_s']:>10.4f} "
            f"{r['plan_with_members_s']:>10.4f} {r['relative_difference']:>+8.2%}"
        )
    worst = max(abs(r["relative_difference"]) for r in rows)
    print(f"{len(rows)} tensor-parallel configurations; largest |difference| {worst:.2%}")
    out = {"command": "benchmarks/tp_plan_agreement.py", "worst_relative_difference": worst, "rows": rows}
    out["elapsed_s"] = time.perf_counter() - t0
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
