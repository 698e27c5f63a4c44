"""How much execution order matters: simulated iteration time under three priority rules.

For captured zoo models on the paper's 8-GPU cluster, random hybrid plans (up to 96
contiguous groups, each on 1–3 random devices with random shares, ring all-reduce) are
simulated with
  graph    no priorities: groups in graph order,
  heteroG  HeteroG's rank (longest path from the sources; earliest-startable first),
  upward   HEFT's upward rank (longest path to the sink, communication included).
Reported: geometric-mean time ratio against `graph`, and how often upward is no slower than
heteroG. Branchy graphs (Inception) leave room for ordering; chains (ResNet) much less.

    .venv/bin/python benchmarks/simulator_priorities.py [--quick]
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

from heterog.capture import capture_model
from heterog.cost import build_cost_model
from heterog.hardware.spec import load_cluster
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.jsonio import write_atomic
from heterog.simulate import assign_priorities, simulate

MODELS = (("inception_v3", 64), ("transformer", 32), ("resnet50", 64))


def random_plan(graph, devices, rng: random.Random, n_groups: int, batch: int) -> Plan:
    names = [n.name for n in graph.nodes]
    bounds = sorted(rng.sample(range(1, len(names)), n_groups - 1))
    bounds = [0, *bounds, len(names)]
    groups = []
    for k in range(n_groups):
        devs = rng.sample(devices, rng.randint(1, 3))
        w = [rng.uniform(0.5, 1.5) for _ in devs]
        groups.append(
            Group(
                name=f"g{k}",
                nodes=tuple(names[bounds[k] : bounds[k + 1]]),
                sync="ring" if len(devs) > 1 else "none",
                replicas=tuple(Replica(device=d, share=x / sum(w)) for d, x in zip(devs, w)),
            )
        )
    return Plan(
        strategy="random",
        model=ModelSpec(name=graph.model, batch_size=batch),
        groups=tuple(groups),
        num_microbatches=rng.choice([1, 4]),
        schedule="gpipe",
    )


def main() -> None:
    quick = "--quick" in sys.argv
    cluster = load_cluster("paper-8gpu")
    devices = [d.name for d in cluster.devices]
    rows = []
    for model, batch in MODELS[:1] if quick else MODELS:
        t0 = time.perf_counter()
        graph = capture_model(model, batch_size=batch)
        costs = build_cost_model(graph, cluster)
        rng = random.Random(0)
        ratios = {"heteroG": [], "upward": []}
        upward_wins = 0
        n_plans = 6 if quick else 20
        for _ in range(n_plans):
            plan = random_plan(graph, devices, rng, min(96, len(graph.nodes) // 2), batch)
            t = {"graph": simulate(graph, cluster, plan, costs, timeline=False).iteration_time_s}
            for method in ("heteroG", "upward"):
                p = assign_priorities(graph, cluster, plan, costs, method)
                t[method] = simulate(graph, cluster, p, costs, timeline=False).iteration_time_s
                ratios[method].append(t[method] / t["graph"])
            upward_wins += t["upward"] <= t["heteroG"] * (1 + 1e-9)
        geo = {m: math.exp(sum(math.log(x) for x in v) / len(v)) for m, v in ratios.items()}
        row = {
            "model": model,
            "batch_size": batch,
            "nodes": len(graph.nodes),
            "plans": n_plans,
            "heteroG_vs_graph_order": geo["heteroG"],
            "upward_vs_graph_order": geo["upward"],
            "upward_no_slower_than_heteroG": upward_wins / n_plans,
            "best_upward_gain_vs_heteroG": min(u / h for u, h in zip(ratios["upward"], ratios["heteroG"])),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(
            f"{model:>13} ({len(graph.nodes)} nodes): time vs graph order — heteroG {geo['heteroG']:.3f}, "
            f"upward {geo['upward']:.3f}; upward ≤ heteroG in {upward_wins}/{n_plans} plans, "
            f"best gain {1 - row['best_upward_gain_vs_heteroG']:.1%}",
            flush=True,
        )
    out = Path(__file__).parent / "results" / "simulator_priorities.json"
    write_atomic(
        out,
        json.dumps(
            {
                "benchmark": "simulator_priorities",
                "cluster": "paper-8gpu",
                "command": "python benchmarks/simulator_priorities.py",
                "rows": rows,
            },
            indent=1,
        )
        + "\n",
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
