"""Simulations per second of heterog.simulate on a ~1000-node graph with ~50-group plans.

Clusters: the built-in paper-8gpu (8 devices), mixed-64 (64) and scale-1024 (1024), with the
analytic cost model. Plans, as the search produces them:
  dp        every group on every device, shares proportional to peak FLOP/s, ring all-reduce
  pipe-dp   8 stages (contiguous groups), each data-parallel over 1/8 of the devices, 4
            micro-batches, 1F1B
  hybrid    a random subset of devices (up to 8) with random shares per group, random sync
"cold" is the first simulation with a fresh cost model (every cost computed); "neighbours" is
the search's case: each call scores a neighbour of the plan (new shares for one group, which
re-partitions the batch around it); "plan itself" re-simulates the unchanged plan. Times are
CPU time of this process (the machine may be shared).

    .venv/bin/python benchmarks/simulator_speed.py [--quick] [--cluster=NAME] [--no-numba] [--out=PATH]

--no-numba measures the simulator as it runs where numba cannot be imported (its loops as
plain Python, HETEROG_NO_NUMBA=1), beside a compiled run of the same plans in a child process,
checks that both simulate every plan alike, and states the slowdown per plan
(results/simulator_speed_no_numba.json). --out: where the JSON goes (default
results/simulator_speed.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_NUMBA_ENV = "HETEROG_NO_NUMBA"  # heterog._jit reads it when heterog is first imported
if "--no-numba" in sys.argv:
    os.environ[NO_NUMBA_ENV] = "1"

from heterog import _jit as jit  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.cost import build_cost_model  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.hardware.spec import load_cluster  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.ir.affine import Affine  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.ir.plan import Group, ModelSpec, Plan, Replica  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.jsonio import write_atomic  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.lower.context import SimCache  # noqa: E402 - after NO_NUMBA_ENV is set
from heterog.simulate import simulate  # noqa: E402 - after NO_NUMBA_ENV is set

N_NODES, N_GROUPS = 1000, 50
CLUSTERS = ("paper-8gpu", "mixed-64", "scale-1024")


def synthetic_graph(batch_size: int) -> OpGraph:
    """A residual network of 250 blocks × (matmul, norm, activation, add); 1000 nodes."""
    nodes, edges = [], []
    width = 1024
    for i in range(N_NODES):
        kind = ("matmul", "norm", "elementwise", "elementwise")[i % 4]
        act = 4.0 * width * 16  # bytes per sample of one activation
        if kind == "matmul":
            flops = 2.0 * width * width * 16
            params = width * width
        else:
            flops, params = 10.0 * width * 16, (2 * width if kind == "norm" else 0)
        nodes.append(
            OpNode(
                name=f"n{i}",
                module_path=f"blocks.{i // 4}.op{i % 4}",
                module_type="X",
                kind=kind,
                fwd_flops=Affine(0, flops),
                bwd_flops=Affine(0, 2 * flops),
                fwd_bytes=Affine(4 * params, 2 * act),
                bwd_bytes=Affine(8 * params, 4 * act),
                saved_bytes=Affine(0, act),
                output_bytes=Affine(0, act),
                workspace_bytes=Affine(0, act / 4),
                param_count=params,
                param_bytes=4 * params,
                param_names=(f"n{i}.w",) if params else (),
                fwd_kernels=1,
                bwd_kernels=2,
                tensor_core_flops_fraction=1.0 if kind == "matmul" else 0.0,
            )
        )
        if i:
            edges.append(OpEdge(src=f"n{i - 1}", dst=f"n{i}", bytes=Affine(0, act)))
        if i % 4 == 3 and i >= 4:
            edges.append(OpEdge(src=f"n{i - 4}", dst=f"n{i}", bytes=Affine(0, act)))  # residual
    return OpGraph(model="synthetic-1000", batch_size=batch_size, nodes=tuple(nodes), edges=tuple(edges)).validate()


def chunks(seq, k):
    n = len(seq)
    return [seq[i * n // k : (i + 1) * n // k] for i in range(k)]


def speed_shares(cluster, devices):
    w = [cluster.gpu(d).peak_flops_per_s["fp32"] / cluster.device(d).slowdown for d in devices]
    s = [x / sum(w) for x in w]
    s[-1] = 1.0 - sum(s[:-1])
    return s


def make_plans(graph, cluster, rng):
    names = [n.name for n in graph.nodes]
    node_sets = [tuple(c) for c in chunks(names, N_GROUPS)]
    devices = [d.name for d in cluster.devices]
    spec = ModelSpec(name="synthetic", batch_size=graph.batch_size)

    def group(k, devs, shares, sync="ring", ps=None):
        return Group(
            name=f"g{k}",
            nodes=node_sets[k],
            sync=sync if len(devs) > 1 else "none",
            ps_device=ps if len(devs) > 1 else None,
            replicas=tuple(Replica(device=d, share=s) for d, s in zip(devs, shares)),
        )

    dp_shares = speed_shares(cluster, devices)
    dp = Plan(strategy="dp", model=spec, groups=tuple(group(k, devices, dp_shares) for k in range(N_GROUPS)))
    stages = chunks(devices, 8)
    stage_groups = chunks(list(range(N_GROUPS)), 8)
    pipe = Plan(
        strategy="pipe-dp",
        model=spec,
        num_microbatches=4,
        schedule="1f1b",
        groups=tuple(group(k, stages[s], speed_shares(cluster, stages[s])) for s in range(8) for k in stage_groups[s]),
    )
    hyb = []
    for k in range(N_GROUPS):
        devs = rng.sample(devices, rng.randint(1, min(8, len(devices))))
        w = [rng.uniform(0.5, 1.5) for _ in devs]
        sync = rng.choice(["ring", "hierarchical", "ps"])
        hyb.append(group(k, devs, [x / sum(w) for x in w], sync, devs[0] if sync == "ps" else None))
    hybrid = Plan(strategy="hybrid", model=spec, groups=tuple(hyb))
    return {"dp": dp, "pipe-dp": pipe, "hybrid": hybrid}


def mutate(plan, rng, cluster):
    """The search's typical move: new shares for one group, by GPU type (the share optimiser
    gives devices of one type equal shares)."""
    k = rng.randrange(len(plan.groups))
    g = plan.groups[k]
    factor = {t: rng.uniform(0.8, 1.25) for t in cluster.gpu_types}
    w = [r.share * factor[cluster.device(r.device).gpu_type] for r in g.replicas]
    g2 = dataclasses.replace(g, replicas=tuple(dataclasses.replace(r, share=x / sum(w)) for r, x in zip(g.replicas, w)))
    return dataclasses.replace(plan, groups=plan.groups[:k] + (g2,) + plan.groups[k + 1 :])


def measure(graph, cluster, plan, min_time_s):
    """CPU time of this process (the machine is shared; wall time is reported beside it)."""
    costs, cache = build_cost_model(graph, cluster), SimCache()  # the search keeps one SimCache
    t0 = time.process_time()
    r = simulate(graph, cluster, plan, costs, timeline=False, cache=cache)
    cold_s = time.process_time() - t0
    rng = random.Random(1)
    neighbours = [mutate(plan, rng, cluster) for _ in range(20)]
    tasks = []
    n, t0, w0 = 0, time.process_time(), time.perf_counter()
    while True:  # neighbours of the plan, as the annealing search scores them
        tasks.append(
            simulate(graph, cluster, neighbours[n % len(neighbours)], costs, timeline=False, cache=cache).num_tasks
        )
        n += 1
        el = time.process_time() - t0
        if el >= min_time_s and n >= 3:
            break
    wall = time.perf_counter() - w0
    k, t1 = 0, time.process_time()
    while k < 3 or time.process_time() - t1 < min_time_s / 4:  # the plan itself, warm
        simulate(graph, cluster, plan, costs, timeline=False, cache=cache)
        k += 1
    base_s = (time.process_time() - t1) / k
    check_warm_equals_cold(graph, cluster, [plan] + neighbours[:2], costs, cache)
    return {
        "cold_s": cold_s,
        "warm_sims_per_s": n / el,
        "warm_ms": 1e3 * el / n,
        "warm_wall_ms": 1e3 * wall / n,
        "plan_sims_per_s": 1 / base_s,
        "tasks": r.num_tasks,
        "neighbour_tasks_mean": sum(tasks) / len(tasks),
        "iteration_time_s": r.iteration_time_s,
        "feasible": r.feasible,
    }


def check_warm_equals_cold(graph, cluster, plans, costs, cache) -> None:
    """The simulator caches pieces of earlier calls (per cost model); a plan simulated with
    warm caches must give exactly what a fresh cost model (cold caches) gives."""
    for plan in plans:
        warm = simulate(graph, cluster, plan, costs, timeline=True, cache=cache)
        cold = simulate(graph, cluster, plan, build_cost_model(graph, cluster), timeline=True)
        assert warm.to_dict() == cold.to_dict() and warm.memory_timeline == cold.memory_timeline, (
            f"plan {plan.strategy}: warm caches changed the simulated result"
        )


def measure_all(quick: bool, only: list[str]) -> list[dict]:
    """One row per (cluster, plan), printed as it is measured."""
    rows = []
    for cname in only or CLUSTERS:
        cluster = load_cluster(cname)
        graph = synthetic_graph(batch_size=max(64, 4 * len(cluster.devices)))
        for pname, plan in make_plans(graph, cluster, random.Random(0)).items():
            m = measure(graph, cluster, plan, 0.3 if quick else 2.0)
            rows.append(
                {
                    "cluster": cname,
                    "devices": len(cluster.devices),
                    "plan": pname,
                    "groups": len(plan.groups),
                    "nodes": len(graph.nodes),
                    **m,
                }
            )
            print(
                f"{cname:>11} {len(cluster.devices):5d} dev  {pname:8s} tasks {m['tasks']:6d} "
                f"(neighbours {m['neighbour_tasks_mean']:7.0f})  cold {m['cold_s'] * 1e3:8.1f} ms  "
                f"neighbours {m['warm_ms']:7.2f} ms CPU = {m['warm_sims_per_s']:7.1f}/s  "
                f"plan itself {m['plan_sims_per_s']:7.1f}/s",
                flush=True,
            )
    return rows


def compiled_rows(args: list[str]) -> list[dict]:
    """The same measurements with numba, in a child process (heterog._jit decides at import)."""
    env = {k: v for k, v in os.environ.items() if k != NO_NUMBA_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compiled.json"
        subprocess.run([sys.executable, __file__, *args, f"--out={out}"], env=env, check=True)
        doc = json.loads(out.read_text())
    if not doc["numba_compiled"]:
        sys.exit(f"numba cannot be imported here ({doc['why_uncompiled']}): no compiled run to compare with")
    return doc["rows"]


def slowdown_rows(compiled: list[dict], uncompiled: list[dict]) -> list[dict]:
    """Per plan, uncompiled ÷ compiled CPU time: a neighbour's simulation (the search's
    case), the plan itself re-simulated, and the first simulation with a fresh cost model."""
    rows = []
    for c, u in zip(compiled, uncompiled, strict=True):
        assert (c["cluster"], c["plan"], c["tasks"]) == (u["cluster"], u["plan"], u["tasks"])
        assert c["iteration_time_s"] == u["iteration_time_s"], (
            f"{c['cluster']} {c['plan']}: the uncompiled simulator's iteration time differs"
        )
        rows.append(
            {
                "cluster": c["cluster"],
                "devices": c["devices"],
                "plan": c["plan"],
                "tasks": c["tasks"],
                "neighbour_ms": {"compiled": c["warm_ms"], "uncompiled": u["warm_ms"]},
                "neighbour_slowdown": u["warm_ms"] / c["warm_ms"],
                "plan_slowdown": c["plan_sims_per_s"] / u["plan_sims_per_s"],
                "cold_slowdown": u["cold_s"] / c["cold_s"],
            }
        )
    for r in rows:
        print(
            f"{r['cluster']:>11} {r['plan']:8s} tasks {r['tasks']:6d}  neighbour "
            f"{r['neighbour_ms']['compiled']:8.2f} ms compiled, {r['neighbour_ms']['uncompiled']:8.2f} ms "
            f"uncompiled: {r['neighbour_slowdown']:5.1f}× slower  (plan itself {r['plan_slowdown']:5.1f}×, "
            f"cold {r['cold_slowdown']:5.1f}×)"
        )
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--cluster=")]
    outs = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")]
    no_numba = "--no-numba" in sys.argv
    name = "simulator_speed_no_numba" if no_numba else "simulator_speed"
    out = Path(outs[0]) if outs else Path(__file__).parent / "results" / f"{name}.json"
    command = " ".join(["python benchmarks/simulator_speed.py", *sys.argv[1:]])
    doc = {
        "benchmark": name,
        "command": command,
        "python": sys.version.split()[0],
        "numba_compiled": jit.COMPILED,
        "why_uncompiled": jit.WHY_UNCOMPILED,
    }
    if no_numba:
        compiled = compiled_rows([a for a in sys.argv[1:] if a == "--quick" or a.startswith("--cluster=")])
        print("uncompiled (HETEROG_NO_NUMBA=1):", flush=True)
        uncompiled = measure_all(quick, only)
        rows = slowdown_rows(compiled, uncompiled)
        ratios = [r["neighbour_slowdown"] for r in rows]
        print(
            f"without numba a neighbour's simulation takes {min(ratios):.1f}–{max(ratios):.1f}× the CPU time "
            f"(median {statistics.median(ratios):.1f}×)"
        )
        doc.update(
            rows=rows,
            compiled_rows=compiled,
            uncompiled_rows=uncompiled,
            neighbour_slowdown={"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
        )
    else:
        doc["rows"] = measure_all(quick, only)
    write_atomic(out, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
