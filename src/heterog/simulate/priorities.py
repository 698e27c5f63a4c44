"""Execution-order priorities: which ready op a device runs first (higher priority first).

Two ranks over the op graph, weighted with the plan's placement:
- 'heteroG' — HeteroG's rank: the longest profiled path from the sources to the op (its
  earliest possible start with unlimited devices, communication ignored). Ops that can start
  earliest run first, so priority = −rank.
- 'upward' — HEFT's upward rank (Topcuoglu, Hariri & Wu, IEEE TPDS 2002): the longest path
  from the op to the sink, counting compute *and* the transfers the placement makes
  (rank(n) = w(n) + max over successors s of (c(n, s) + rank(s))). The op that heads the
  longest remaining chain runs first, which also sends data to waiting devices early.

w(n) is the mean over the replicas of n's group of its forward + backward time at the
replica's samples of the first micro-batch; c(n, s) is the slowest re-partition transfer of
the edge's bytes when the two groups are placed differently, 0 otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.lower.blocks import overlaps
from heterog.lower.context import SimCache
from heterog.lower.schedule import check_plan

METHODS = ("upward", "heteroG")


def node_weights_s(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, cache: SimCache | None = None
) -> dict[str, float]:
    """w(n): mean forward + backward time of each node over its group's replicas."""
    cache = cache if cache is not None else SimCache()
    info, _ = check_plan(graph, cluster, plan, cache, costs)
    table = cache.cost_table(graph, costs)
    out: dict[str, float] = {}
    for g in plan.groups:
        samples = plan.replica_samples(g, 0)
        reps = [(info.dev_class[info.dev_id[r.device]], s) for r, s in zip(g.replicas, samples)]
        for n in g.nodes:
            total = 0.0
            for dev, s in reps:
                f, b = table.times_s((n,), dev, s)
                total += f + b
            out[n] = total / len(reps)
    return out


def edge_costs_s(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, cache: SimCache | None = None
) -> dict[tuple[str, str], float]:
    """c(u, v) for edges between differently placed groups: the slowest of the transfers the
    re-partition of that edge makes (replicas own contiguous sample ranges)."""
    cache = cache if cache is not None else SimCache()
    info, grp = check_plan(graph, cluster, plan, cache, costs)
    table = cache.cost_table(graph, costs)
    size = plan.microbatch_size(0)
    out: dict[tuple[str, str], float] = {}
    for (ga, gb), edges in grp.cross.items():
        a, b = plan.groups[ga], plan.groups[gb]
        if a.replicas == b.replicas:
            continue
        moves = [
            (a.replicas[i].device, b.replicas[j].device, n)
            for i, j, n in overlaps(plan.replica_samples(a, 0), plan.replica_samples(b, 0))
        ]
        for src, dst in edges:
            fx, ps = table.edge_bytes(src, dst)
            worst = 0.0
            for da, db, n in moves:
                nbytes = fx * n / size + ps * n
                if da != db and nbytes > 0:
                    fixed, per_byte = table.transfer_line(da, db)
                    worst = max(worst, fixed + per_byte * nbytes)
            if worst:
                out[(src, dst)] = worst
    return out


def node_ranks(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, method: str = "upward", cache: SimCache | None = None
) -> dict[str, float]:
    """The rank of every node (seconds) under `method` (see the module docstring)."""
    if method not in METHODS:
        raise PlanError(f"priority method {method!r} is not one of {', '.join(METHODS)}.")
    cache = cache if cache is not None else SimCache()
    w = node_weights_s(graph, cluster, plan, costs, cache)
    rank: dict[str, float] = {}
    if method == "upward":
        c = edge_costs_s(graph, cluster, plan, costs, cache)
        succ = graph.successors
        for n in reversed(graph.nodes):  # graph nodes are in topological order
            best = 0.0
            for s in succ[n.name]:
                v = c.get((n.name, s), 0.0) + rank[s]
                if v > best:
                    best = v
            rank[n.name] = w[n.name] + best
    else:
        pred = graph.predecessors
        for n in graph.nodes:
            rank[n.name] = max((rank[p] + w[p] for p in pred[n.name]), default=0.0)
    return rank


def assign_priorities(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, method: str = "upward", cache: SimCache | None = None
) -> Plan:
    """The plan with `priorities` filled (node → priority, higher runs first)."""
    rank = node_ranks(graph, cluster, plan, costs, method, cache)
    if method == "heteroG":
        prio = {n: -r for n, r in rank.items()}
    else:
        prio = dict(rank)
    return replace(plan, priorities=prio)
