"""Coarsen an OpGraph into at most K groups that the search places as units.

HeteroG clustered ops around the k most expensive ones; its groups could interleave, so a
group's inputs might come from a later group. Here a group is a contiguous segment of the
graph's topological (execution) order, so every edge between groups points forward: the
group graph is a DAG and groups execute in order. Segments are balanced by weight (compute
time on a reference device plus the time to synchronise the node's gradients), heavy nodes
(weight ≥ one segment's share) are isolated as centres of their own group, as HeteroG did,
and each cut is moved, within a band of ±25% of the target weight, to where the fewest
activation bytes cross it (a cheaper boundary for model or pipeline parallelism).
Then the grouping is made to match what the executor can cut (respect_cuts): a batch
statistic's producer and consumer share a group, and nodes that depend on no input data join
their consumers' group.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from heterog.cost.model import CostModel
from heterog.hardware.cluster import Cluster
from heterog.ir.affine import Affine
from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpGraph
from heterog.lower.blocks import sent_once
from heterog.search.constraints import ModelCuts


def node_weights_s(graph: OpGraph, cluster: Cluster, costs: CostModel) -> list[float]:
    """Per node: forward + backward time at the full batch on the median-speed device, plus
    the time to move its gradient once over the cluster's slowest pair of devices."""
    devices = [d.name for d in cluster.devices]
    ref = devices[len(devices) // 2]
    if len(devices) > 1:
        t1 = costs.transfer_time_s(1e6, devices[0], devices[-1])
        t2 = costs.transfer_time_s(2e6, devices[0], devices[-1])
        per_byte_s = max(0.0, (t2 - t1) / 1e6)
    else:
        per_byte_s = 0.0
    b = float(graph.batch_size)
    out = []
    for n in graph.nodes:
        t = costs.compute_time_s(n.name, ref, b, Phase.FORWARD) + costs.compute_time_s(n.name, ref, b, Phase.BACKWARD)
        out.append(t + 2.0 * n.param_bytes * per_byte_s)
    return out


def crossing_bytes(graph: OpGraph) -> list[float]:
    """crossing[i]: activation bytes (at the reference batch) on edges that a cut just before
    node i would sever; crossing[0] = 0."""
    n = len(graph.nodes)
    diff = [0.0] * (n + 1)
    idx = graph.index
    for e in graph.edges:
        a, b = idx[e.src], idx[e.dst]
        nbytes = e.bytes.at(graph.batch_size)
        diff[a + 1] += nbytes
        diff[b + 1] -= nbytes
    out = list(accumulate(diff))[:n]
    out[0] = 0.0
    return out


def contiguous_groups(graph: OpGraph, weights: Sequence[float], max_groups: int) -> list[tuple[str, ...]]:
    """Split the nodes (in graph order) into ≤ max_groups contiguous, weight-balanced segments."""
    n = len(graph.nodes)
    assert len(weights) == n and max_groups >= 1
    if n <= max_groups:
        return [(node.name,) for node in graph.nodes]
    prefix = [0.0, *accumulate(max(w, 0.0) for w in weights)]
    total = prefix[-1] or 1.0
    target = total / max_groups
    cross = crossing_bytes(graph)
    cuts: set[int] = set()  # a cut at i separates node i-1 from node i
    for k in range(1, max_groups):
        ideal = k * target
        lo = bisect_left(prefix, ideal - 0.25 * target)
        hi = bisect_left(prefix, ideal + 0.25 * target)
        lo, hi = max(1, lo), min(n - 1, max(lo, hi))
        if lo > hi:
            continue
        # fewest bytes crossing; ties broken by closeness to the balanced position
        best = min(range(lo, hi + 1), key=lambda i: (cross[i], abs(prefix[i] - ideal)))
        cuts.add(best)
    for i, w in enumerate(weights):  # heavy nodes are centres of their own group
        if w >= target:
            if i > 0:
                cuts.add(i)
            if i + 1 < n:
                cuts.add(i + 1)
    bounds = [0, *sorted(cuts), n]
    segments = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    while len(segments) > max_groups:  # merge the lightest adjacent pair
        j = min(range(len(segments) - 1), key=lambda s: prefix[segments[s + 1][1]] - prefix[segments[s][0]])
        segments[j : j + 2] = [(segments[j][0], segments[j + 1][1])]
    names = [node.name for node in graph.nodes]
    return [tuple(names[a:b]) for a, b in segments]


def group_graph(graph: OpGraph, groups: Sequence[Sequence[str]]) -> dict[tuple[int, int], Affine]:
    """Edges between groups: (src group, dst group) → Affine bytes that cross, each producer's
    tensor once however many nodes of the consumer group read it (lower.blocks.sent_once)."""
    owner = {name: gi for gi, names in enumerate(groups) for name in names}
    crossing: dict[tuple[int, int], list] = {}
    for e in graph.edges:
        a, b = owner[e.src], owner[e.dst]
        if a != b:
            crossing.setdefault((a, b), []).append((e.src, e.bytes))
    out: dict[tuple[int, int], Affine] = {}
    for key, edges in crossing.items():  # the lowering's rule: a tensor crosses once
        moved = sent_once(edges, lambda b: b.fixed + b.per_sample)
        total = moved[0]
        for x in moved[1:]:
            total = total + x
        out[key] = total
    return out


def respect_cuts(graph: OpGraph, groups: Sequence[Sequence[str]], cuts: ModelCuts | None) -> list[tuple[str, ...]]:
    """The grouping made to match what the executor does (search/constraints.py):
    - no boundary between the two ends of a `same_placement` pair (the groups from one to
      the other are merged), so a batch statistic never crosses between placements;
    - a `follow_consumers` node moves to its earliest consumer's group, where the executor
      runs it (edges into it come from earlier groups, edges out go to that group or later
      ones, so the group graph stays acyclic).
    Names the graph does not have are skipped (the executor checks them again)."""
    out = [list(g) for g in groups]
    if cuts is None or not (cuts.same_placement or cuts.follow_consumers):
        return [tuple(g) for g in out]
    owner = {name: gi for gi, names in enumerate(out) for name in names}
    glue = [False] * max(0, len(out) - 1)  # glue[k]: groups k and k+1 must stay one
    for a, b in cuts.same_placement:
        if a in owner and b in owner:
            lo, hi = sorted((owner[a], owner[b]))
            for k in range(lo, hi):
                glue[k] = True
    merged: list[list[str]] = [out[0]] if out else []
    for k in range(1, len(out)):
        if glue[k - 1]:
            merged[-1].extend(out[k])
        else:
            merged.append(out[k])
    owner = {name: gi for gi, names in enumerate(merged) for name in names}
    index = graph.index
    consumers: dict[str, list[str]] = {}
    for e in graph.edges:
        consumers.setdefault(e.src, []).append(e.dst)
    for f in sorted((f for f in cuts.follow_consumers if f in owner), key=lambda n: -index[n]):
        used = [owner[c] for c in consumers.get(f, ()) if c in owner]
        target = min(used, default=owner[f])
        if target != owner[f]:
            merged[owner[f]].remove(f)
            merged[target].append(f)
            owner[f] = target
    return [tuple(sorted(g, key=index.__getitem__)) for g in merged if g]


def make_groups(
    graph: OpGraph, cluster: Cluster, costs: CostModel, max_groups: int = 32, cuts: ModelCuts | None = None
) -> list[tuple[str, ...]]:
    """The search's unit of placement: ≤ max_groups contiguous, balanced segments, adjusted
    to the executor's cut constraints when given (respect_cuts)."""
    groups = contiguous_groups(graph, node_weights_s(graph, cluster, costs), max_groups)
    return respect_cuts(graph, groups, cuts)
