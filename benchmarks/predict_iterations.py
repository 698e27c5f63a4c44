"""Whole multi-GPU training iterations, predicted by heterog and measured.

The measurements (heterog/cost/data/amp_homogeneous_iterations.json) are AMP's public runs of
a GPT-2 model (hidden 1024, 24 layers, seq 1024, fp16, global batch 32, Adam) on 16 T4s in 4
nodes under DeepSpeed's pipeline engine (1F1B), each configuration a (tensor, data, pipeline)
degree, a micro-batch size and stage boundaries over DeepSpeed's 30 layer specs. Each
configuration becomes a heterog Plan on the same devices: the same stages over the same
layers, the same ranks (DeepSpeed's default topology: rank = (stage · dp + replica) · tp +
tensor rank, filling the nodes in order), even batch shares, ring all-reduce, the same
micro-batch count, 1F1B. A tensor-parallel group is placed on its first rank and priced by
Megatron's split (heterog/cost/tensor_parallel.py: one rank's slice of every block, the
per-block all-reduces over the group's PCIe links, the t sibling rings between groups;
vocabulary-parallel embedding and head, as Megatron pads the vocabulary for). heterog's
simulator predicts its iteration from the cost model alone (the T4's figures come from public
figures: nothing is fitted to these runs), and its memory model says whether it fits; the
runs that failed (out of memory or error) are compared with that. Errors are reported for
tp = 1 and tp > 1 apart, beside AMP's own predictions.

heterog's zoo `gpt2-medium` is the same architecture (tied embedding; the unpadded vocabulary
50257 where Megatron pads to 50304), and its `fp16` precision is autocast over fp32 weights,
where Megatron keeps fp16 weights and fp32 master copies: the same 16 bytes of state per
parameter with Adam, different activation dtypes in the norms and the loss.

    .venv/bin/python benchmarks/predict_iterations.py          # all 52 configurations (~10 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "predict_iterations.json"
MODEL = "gpt2-medium"
ONE_BUCKET_BYTES = 2**40  # more than every gradient together


def load_runs() -> dict[str, Any]:
    return json.loads(resources.files("heterog.cost").joinpath("data", "amp_homogeneous_iterations.json").read_text())


def layer_spec(node: str) -> int:
    """DeepSpeed GPT2ModelPipe's layer spec (0..29) of a node of heterog's gpt2-medium graph:
    0 the embeddings, 2 + i transformer block i, 27 the final norm, 28 the tied head, 29 the
    loss (1 and 26 are transposes heterog's graph does not have)."""
    m = re.search(r"\bh\.(\d+)\b", node)
    if m:
        return 2 + int(m.group(1))
    if node.startswith("transformer.ln_f") or node.startswith("transformer::view@3"):
        return 27
    if node.startswith("loss"):
        return 29
    if node == "lm_head" or node.startswith("root::"):
        return 28
    return 0


def plan_of(run: dict[str, Any], prob, spec_groups: list[int]):
    """heterog's Strategy for one AMP configuration: each (stage, replica) is one
    tensor-parallel group, placed on its first rank, (stage · dp + replica) · tp (DeepSpeed's
    default topology, the model axis fastest); the cost model knows the group's other ranks."""
    from heterog.search.problem import Placement, Strategy

    p = run["plan"]
    dp, tp, bounds = p["dp"], p["tp"], p["pipeline_boundaries_over_30_layer_specs"]
    placements = [None] * prob.n_groups
    for stage in range(p["pp"]):
        devices = tuple((stage * dp + r) * tp for r in range(dp))
        place = Placement(devices, tuple([1.0 / dp] * dp), "ring" if dp > 1 else "none")
        for g, spec in enumerate(spec_groups):
            if bounds[stage] <= spec < bounds[stage + 1]:
                placements[g] = place
    assert all(x is not None for x in placements), bounds
    return Strategy(tuple(placements), p["num_microbatches"], "1f1b")


def problem_for(graph, cluster, costs, spec):
    """The search Problem over DeepSpeed's layer specs (one group per spec) and its specs."""
    from heterog.search.problem import Problem

    by_spec: dict[int, list[str]] = {}
    for n in graph.nodes:
        by_spec.setdefault(layer_spec(n.name), []).append(n.name)
    spec_groups = sorted(by_spec)
    prob = Problem(
        graph=graph,
        cluster=cluster,
        costs=costs,
        groups=[tuple(by_spec[s]) for s in spec_groups],
        batch_size=32,
        model_spec=spec,
        precision="fp16",
        optimizer="adamw",
    )
    return prob, spec_groups


def tensor_parallel_costs(graph, cluster, tp: int):
    """The cost model of one rank of tp-way Megatron tensor parallelism (vocabulary-parallel
    embedding and head, as Megatron pads the vocabulary for), every group tp consecutive ranks."""
    from heterog.cost.tensor_parallel import TensorParallelCostModel

    names = [d.name for d in cluster.devices]
    groups = {names[i]: names[i : i + tp] for i in range(0, len(names), tp)}
    return TensorParallelCostModel(
        graph, cluster, degree=tp, groups=groups, vocab_parallel=True, precision="fp16", optimizer="adamw"
    )


def predict_all(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from heterog.hardware.spec import cluster_from_dict
    from heterog.inputs import model_inputs
    from heterog.ir.plan import ModelSpec
    from heterog.simulate.simulator import simulate

    data = load_runs()
    spec = ModelSpec(name=MODEL, batch_size=32, seq_len=1024)
    doc = dict(data["cluster"])
    doc["description"] = doc.pop("note", "")  # the file's free-text field under heterog's name
    graph, cluster, costs = model_inputs(spec, cluster_from_dict(doc), precision="fp16", optimizer="adamw")
    problems = {1: problem_for(graph, cluster, costs, spec)}
    rows = []
    for run in runs:
        p = run["plan"]
        row = {
            "tp": p["tp"],
            "dp": p["dp"],
            "pp": p["pp"],
            "micro_batch": p["micro_batch"],
            "microbatches": p["num_microbatches"],
            "measured_s": run["measured_iter_s"],
            "amp_predicted_s": run["predicted_iter_s"],
        }
        if p["tp"] not in problems:
            tp_costs = tensor_parallel_costs(graph, cluster, p["tp"])
            problems[p["tp"]] = problem_for(tp_costs.graph, cluster, tp_costs, spec)
        prob, spec_groups = problems[p["tp"]]
        name = f"amp-tp{p['tp']}-dp{p['dp']}-pp{p['pp']}-mb{p['micro_batch']}"
        plan = prob.to_plan(plan_of(run, prob, spec_groups), name)
        sim = simulate(prob.graph, cluster, plan, prob.costs)
        # DeepSpeed's pipeline engine reduces the gradients once, after the last micro-batch's
        # backward (TrainSchedule: ReduceTiedGrads, ReduceGrads, OptimizerStep at the end of the
        # batch), where heterog overlaps buckets with the backward: one bucket holding every
        # gradient is that schedule.
        one = dataclasses.replace(plan, bucket_bytes=ONE_BUCKET_BYTES)
        as_run = simulate(prob.graph, cluster, one, prob.costs)
        peak = max(sim.peak_memory_bytes.values())
        if p["tp"] > 1:  # the first stage's all-reduces within its group, every micro-batch
            first = [
                n
                for g, spec in zip(prob.groups, spec_groups)
                if spec < p["pipeline_boundaries_over_30_layer_specs"][1]
                for n in g
            ]
            device = cluster.devices[0].name
            row["tp_allreduce_s"] = p["num_microbatches"] * prob.costs.group_collectives_time_s(
                first, device, p["micro_batch"]
            )
        rows.append(
            {
                **row,
                "predicted_s": sim.iteration_time_s,
                "predicted_one_reduce_s": as_run.iteration_time_s,
                "fits": sim.feasible,
                "peak_memory_gib": peak / 2**30,
            }
        )
    return rows


def error(row: dict[str, Any], key: str) -> float | None:
    if row.get(key) is None or row["measured_s"] is None:
        return None
    return row[key] / row["measured_s"] - 1.0


def _errors(done: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    signed = [error(r, key) for r in done]
    if not signed:
        return {"median_abs_error": None, "worst_abs_error": None, "median_signed_error": None}
    return {
        "median_abs_error": statistics.median(abs(e) for e in signed),
        "worst_abs_error": max(abs(e) for e in signed),
        "median_signed_error": statistics.median(signed),
    }


def _family(done: list[dict[str, Any]]) -> dict[str, Any]:
    """heterog's errors (its own schedule and DeepSpeed's) and AMP's, over `done`."""
    return {
        "configurations": len(done),
        **_errors(done, "predicted_s"),
        "one_reduce": _errors(done, "predicted_one_reduce_s"),
        "amp": _errors(done, "amp_predicted_s"),
    }


def _ratios(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r["measured_s"] is not None]
    failed = [r for r in rows if r["measured_s"] is None]
    return {
        "configurations": len(rows),
        "measured": len(done),
        "all": _family(done),
        "tp1": _family([r for r in done if r["tp"] == 1]),
        "tp_gt1": _family([r for r in done if r["tp"] > 1]),
        # a diagnostic, not a correction: how many times the predicted tensor-parallel
        # all-reduce time the shortfall of DeepSpeed's schedule is, run by run
        "tp_shortfall_over_allreduce": _ratios(
            [(r["measured_s"] - r["predicted_one_reduce_s"]) / r["tp_allreduce_s"] for r in done if r["tp"] > 1]
        ),
        "failed_runs": len(failed),
        "failed_runs_predicted_not_to_fit": sum(1 for r in failed if not r["fits"]),
        "ran_but_predicted_not_to_fit": sum(1 for r in done if not r["fits"]),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = predict_all(load_runs()["iterations"])
    s = summarize(rows)
    from tables import predict_iterations as render  # the README's renderer: one table format

    print("\n".join(render({"summary": s, "rows": rows}, False)))
    doc = {
        "command": "benchmarks/predict_iterations.py",
        "summary": s,
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
