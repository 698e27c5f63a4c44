"""Time to export and split zoo models into two groups (what every rank does at start-up).

python benchmarks/split_export.py [--out benchmarks/results/split_export.json]

Each model at its default size, built with real parameters, cut in the middle of its
captured node list (groups on different devices); reports the export+split time, the
stages and tied parameters, and checks that the stages hold the model's own parameters.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from heterog.capture import capture_model
from heterog.capture.zoo import get_zoo_model
from heterog.cut.partition import split_model
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.jsonio import write_atomic

MODELS = [
    ("toy-cnn", None),
    ("resnet50", None),
    ("transformer", 128),
    ("gpt2", 1024),
    ("bert-large", 512),
    ("llama", 512),
    ("xlnet-large", 512),
]


def measure(name: str, seq: int | None) -> dict:
    nodes = [n.name for n in capture_model(name, batch_size=2, seq_len=seq).nodes]
    k = len(nodes) // 2
    plan = Plan(
        strategy="bench",
        model=ModelSpec(name=name, batch_size=2, seq_len=seq),
        groups=(
            Group(name="a", nodes=tuple(nodes[:k]), replicas=(Replica(device="d0", share=1.0),)),
            Group(name="b", nodes=tuple(nodes[k:]), replicas=(Replica(device="d1", share=1.0),)),
        ),
    )
    torch.manual_seed(0)
    model = get_zoo_model(name).build()
    t0 = time.perf_counter()
    flow = split_model(model, plan)
    split_s = time.perf_counter() - t0
    own = {id(p) for p in model.parameters()}
    held = {id(p) for s in flow.stages for p in s.module.parameters()}
    return {
        "model": name,
        "nodes": len(nodes),
        "split_s": round(split_s, 2),
        "stages": len(flow.stages),
        "tied": sorted(flow.tied),
        "stage_params_are_the_models": held <= own,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/split_export.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, seq in MODELS:
        rows.append(measure(name, seq))
        print(json.dumps(rows[-1]), flush=True)
    write_atomic(args.out, json.dumps({"torch": torch.__version__, "threads": 1, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
