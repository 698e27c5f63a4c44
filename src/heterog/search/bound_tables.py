"""The inputs of the lower bound's linear programme (bound.py), made once per problem: per
device tier and group the convex call times (call_hull.py) and optimizer steps, one sample's
chains through the group DAG, the activations that cross between groups, and the bandwidth of
ports and NICs that gradients and activations pass."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from heterog.hardware.cluster import Link
from heterog.search.bound_tp import TpRelaxation
from heterog.search.call_hull import sizes, under
from heterog.search.problem import Problem


@dataclass(frozen=True, slots=True)
class Tables:
    n: np.ndarray  # devices per tier
    per_node: np.ndarray  # devices per node of each tier
    under: list  # [t][g] → (knots, values, edges)
    opt_s: np.ndarray  # [t, g]
    grad_bytes: np.ndarray  # [g]
    port_bytes_per_s: float  # all devices' ports together
    nic_bytes_per_s: float  # all nodes' NICs together
    batch: int
    before_s: np.ndarray  # [g] the least time before any forward of group g can start
    after_s: np.ndarray  # [g] the least time after any backward of group g ends
    path: tuple[int, ...]  # the groups of a longest path through the group DAG (one sample, fastest tier)
    act_edges: tuple[tuple[int, int, float], ...]  # (producer, consumer, bytes per sample only it reads)
    port_by_tier: np.ndarray  # [t] its devices' send ports together (inf: not modelled)
    nic_by_tier: np.ndarray  # [t] its nodes' NICs together (inf: a node shared with another tier, or not modelled)
    cross_s: np.ndarray  # [edge of act_edges] least time of a sample's tensor and gradient between nodes (0: unknown)
    set_deg: np.ndarray  # [t] the widest tensor-parallel set on the tier (bound_tp.py; 1: none)
    member: list  # [t][g] → {degree d: h's hull on a member of a set splitting g d ways} (d = 1: under)
    fastest: list  # [t][g] → the hull under a member's least time at each size over those degrees (its calls)


def total_bandwidth(links: list[Link | None]) -> float:
    """The links' summed bandwidth; unbounded when any of them is missing (not modelled)."""
    if any(link is None for link in links):
        return float("inf")
    return sum(link.bandwidth_bytes_per_s for link in links if link is not None)


def chains(prob: Problem, fwd1: np.ndarray, bwd1: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Per group, the longest path over its ancestors of one sample's forward times (nothing
    of group g computes before one sample has passed them) and of its backward times (after
    g's backward of a sample, its ancestors' must follow); fastest tier's times. And the
    groups of the longest path by one sample's forward + backward, which every sample takes."""
    before, after = np.zeros(prob.n_groups), np.zeros(prob.n_groups)
    through, came_from = fwd1 + bwd1, [-1] * prob.n_groups
    for g in range(prob.n_groups):  # groups are in topological order
        for p in prob.preds[g]:
            before[g] = max(before[g], before[p] + fwd1[p])
            after[g] = max(after[g], after[p] + bwd1[p])
            if through[p] + fwd1[g] + bwd1[g] > through[g]:
                through[g], came_from[g] = through[p] + fwd1[g] + bwd1[g], p
    path, g = [], int(np.argmax(through))
    while g >= 0:
        path.append(g)
        g = came_from[g]
    return before, after, tuple(reversed(path))


def exclusive_activations(prob: Problem) -> tuple[tuple[int, int, float], ...]:
    """Per pair of groups (a, b), the bytes per sample of a's tensors that b alone (of the
    other groups) reads: a sample whose a and b run on different devices sends them forward,
    and their gradient comes back (lower/transfers.py). Tensors read by several groups may
    cross once for all of them (lower/blocks.sent_once), so they are left out."""
    owner = {name: g for g, names in enumerate(prob.groups) for name in names}
    readers: dict[str, dict[int, float]] = {}
    for e in prob.graph.edges:
        a, b = owner[e.src], owner[e.dst]
        if a != b:
            mine = readers.setdefault(e.src, {})
            mine[b] = max(mine.get(b, 0.0), float(e.bytes.per_sample))
    out: dict[tuple[int, int], float] = {}
    for src, by_group in readers.items():
        if len(by_group) == 1:
            ((b, nbytes),) = by_group.items()
            out[(owner[src], b)] = out.get((owner[src], b), 0.0) + nbytes
    return tuple((a, b, nbytes) for (a, b), nbytes in sorted(out.items()) if nbytes > 0)


def one_sample_times(prob: Problem, tp: TpRelaxation) -> tuple[np.ndarray, np.ndarray]:
    """Per group, one sample's least forward and backward time: over the tiers, on a member of
    a set of any degree the tier allows (bound_tp.TpRelaxation.member_s; 1: unsplit)."""
    fwd, bwd = np.full(prob.n_groups, np.inf), np.full(prob.n_groups, np.inf)
    for t in range(len(prob.tiers)):
        for g in range(prob.n_groups):
            for d in tp.degrees(t, g):
                ((f, b),) = tp.member_s(prob, t, g, d, [1])
                fwd[g], bwd[g] = min(fwd[g], f), min(bwd[g], b)
    return fwd, bwd


def tables(prob: Problem, fwd1: np.ndarray, bwd1: np.ndarray, deadline_s: float, tp: TpRelaxation) -> Tables | None:
    """The programme's inputs; None when deadline_s passes first (a second or two at a
    thousand devices: the cost model at every size, per class and group). fwd1, bwd1: one
    sample's times per group, on a member where a set may split the group."""
    c = prob.cluster
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    asked = sizes(prob.batch_size)
    made: dict[tuple, tuple] = {}  # (class, group, 1) or (tier, group, degree) → (times at the sizes asked, their hull)
    tiers = prob.tiers
    unsplit, member, quick, opt = [], [], [], np.zeros((len(tiers), prob.n_groups))
    for t, devs in enumerate(tiers):
        rep = prob.device_names[devs[0]]
        cls = int(prob.dev_class[devs[0]])
        mine, quickest = [], []
        for g in range(prob.n_groups):
            # a set's member depends on the set's links: its entry is the tier's
            keys = {d: (cls, g, 1) if d == 1 else (t, g, d) for d in tp.degrees(t, g)}
            for d, key in keys.items():
                if key not in made:
                    if time.perf_counter() >= deadline_s:
                        return None
                    times = [f + b for f, b in tp.member_s(prob, t, g, d, asked)]
                    made[key] = (times, under(asked, times))
            by_degree = {d: made[key] for d, key in keys.items()}
            mine.append({d: hull for d, (_, hull) in by_degree.items()})
            least = [min(c) for c in zip(*(times for times, _ in by_degree.values()))]
            quickest.append(mine[-1][1] if len(by_degree) == 1 else under(asked, least))
        unsplit.append([m[1] for m in mine])
        member.append(mine)
        quick.append(quickest)
        opt[t] = [table.optimizer_s(tuple(names), rep) for names in prob.groups]
    before, after, path = chains(prob, fwd1, bwd1)
    node = {n.name: n for n in c.nodes}
    per_node = np.array([len(node[c.devices[devs[0]].node].devices) for devs in tiers], dtype=float)
    port = total_bandwidth([c.links.get(c.port(d.name, "up")) for d in c.devices])
    port_by_tier = np.array(
        [total_bandwidth([c.links.get(c.port(c.devices[d].name, "up")) for d in devs]) for devs in tiers]
    )
    nic = total_bandwidth([c.links.get(c.nic(n.name, "up")) for n in c.nodes])
    tier_of = {prob.device_names[d]: t for t, devs in enumerate(tiers) for d in devs}
    nic_by_tier = np.full(len(tiers), np.inf)
    for t, devs in enumerate(tiers):
        nodes = {c.devices[d].node for d in devs}
        if all(tier_of[name] == t for n in nodes for name in node[n].devices):
            nic_by_tier[t] = total_bandwidth([c.links.get(c.nic(n, "up")) for n in sorted(nodes)])
    nics = [c.links.get(c.nic(n.name, d)) for n in c.nodes for d in ("up", "down")]
    act_edges = exclusive_activations(prob)
    cross = np.zeros(len(act_edges))
    if np.all(np.isfinite(nic_by_tier)) and all(link is not None for link in nics):
        fastest = max(link.bandwidth_bytes_per_s for link in nics if link is not None)
        latency = min(link.latency_s for link in nics if link is not None)
        cross = np.array([2.0 * (nbytes / fastest + latency) for _, _, nbytes in act_edges])
    return Tables(
        n=np.array([len(d) for d in tiers], dtype=float),
        per_node=per_node,
        under=unsplit,
        opt_s=opt,
        grad_bytes=np.asarray(prob.grad_bytes, dtype=float),
        port_bytes_per_s=port,
        nic_bytes_per_s=nic,
        batch=prob.batch_size,
        before_s=before,
        after_s=after,
        path=path,
        act_edges=act_edges,
        cross_s=cross,
        port_by_tier=port_by_tier,
        nic_by_tier=nic_by_tier,
        set_deg=tp.set_deg,
        member=member,
        fastest=quick,
    )
