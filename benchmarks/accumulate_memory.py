"""Per-replica gradient accumulation, run against its prediction on an emulated cluster.

A three-layer MLP (1024 wide, AdamW, fp32, batch 4096) in data parallelism over two one-thread
CPU devices at equal shares, the first capped at 64 MiB (execute/emulation.py MemoryCap: the
run fails if its live tensors pass the cap after an instruction). The capped replica runs its
2048 samples in 1, 2 or 4 pieces (`Replica.accumulate`); for reference, the whole batch in two
1F1B micro-batches. Per plan: the simulator's peak for the capped device beside the peak its
live tensors reached (peak_live_bytes), and the iteration time predicted beside the median
measured (a shared, loaded machine: times are noisy, memory is not).

    .venv/bin/python benchmarks/accumulate_memory.py --out benchmarks/results/accumulate_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from heterog.capture import capture_model
from heterog.errors import HeterogError
from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Limits, LinkConfig, OutputConfig, RunOptions
from heterog.jsonio import write_atomic
from heterog.runs import run

CLUSTER_YAML = """
name: capped-accumulate
kind: emulated
nodes:
  - name: n
    nic_bandwidth_gbps: 10
    devices:
      - {type: cpu, name: n/small, memory_gib: 0.0625}
      - {type: cpu, name: n/big}
"""
MODEL_ARGS = {"in_features": 1024, "hidden": 1024, "layers": 3, "out_features": 10}
BATCH = 4096
CASES = (("1 piece", 1, 1, "gpipe"), ("2 pieces", 2, 1, "gpipe"), ("4 pieces", 4, 1, "gpipe"))
REFERENCE = ("2 micro-batches, 1F1B", 1, 2, "1f1b")


def make_plan(cluster, nodes: tuple[str, ...], count: int, microbatches: int, schedule: str) -> Plan:
    replicas = (Replica(device="n/small", share=0.5, accumulate=count), Replica(device="n/big", share=0.5))
    return Plan(
        strategy="accumulate",
        model=ModelSpec(name="mlp", args=MODEL_ARGS, batch_size=BATCH),
        groups=(Group(name="all", nodes=nodes, replicas=replicas, sync="ring"),),
        num_microbatches=microbatches,
        schedule=schedule,
        optimizer="adamw",
        cluster=cluster_to_dict(cluster),
        cluster_fingerprint=cluster.fingerprint(),
    ).validate()


def measure(plan: Plan, steps: int, out_dir: Path) -> dict:
    options = RunOptions(steps=steps, limits=Limits(timeout_s=600), links=LinkConfig(shape=False))
    try:
        res = run(plan, options, output=OutputConfig(out_dir=str(out_dir)))
    except HeterogError as e:  # the cap refused the plan: say where
        return {"error": str(e).splitlines()[0][:300]}
    rank = next(r for r in res.per_rank if r.device == "n/small")
    return {
        "predicted_peak_bytes": rank.predicted_peak_memory_bytes,
        "measured_peak_bytes": rank.peak_live_bytes,
        "cap_bytes": rank.memory_cap_bytes,
        "predicted_iteration_s": res.predicted_iteration_time_s,
        "measured_iteration_s": res.measured_iteration_time_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/accumulate_memory.json")
    ap.add_argument("--work", default="/tmp/heterog-accumulate-memory", help="the runs' output folders")
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 64 MiB is deliberately implausible for a device
        cluster = parse_cluster_yaml(CLUSTER_YAML, "<accumulate_memory>")
    nodes = tuple(n.name for n in capture_model("mlp", MODEL_ARGS, batch_size=BATCH).nodes)
    rows = []
    print(f"{'plan':<24} {'predicted peak':>15} {'measured peak':>14} {'ratio':>6} {'predicted':>10} {'measured':>10}")
    for label, count, microbatches, schedule in (*CASES, REFERENCE):
        got = measure(make_plan(cluster, nodes, count, microbatches, schedule), args.steps, Path(args.work) / label)
        rows.append({"plan": label, "count": count, "microbatches": microbatches, "schedule": schedule, **got})
        if "error" in got:
            print(f"{label:<24} refused: {got['error']}")
            continue
        pred, meas = got["predicted_peak_bytes"], got["measured_peak_bytes"]
        print(
            f"{label:<24} {pred / 2**20:>11.1f} MiB {meas / 2**20:>10.1f} MiB {meas / pred:>6.3f} "
            f"{got['predicted_iteration_s'] * 1e3:>7.0f} ms {got['measured_iteration_s'] * 1e3:>7.0f} ms"
        )
    doc = {"command": " ".join(["python", *sys.argv]), "batch": BATCH, "model_args": MODEL_ARGS, "rows": rows}
    write_atomic(Path(args.out), json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
