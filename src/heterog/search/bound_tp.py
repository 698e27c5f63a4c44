"""What tensor parallelism may do, for the lower bound (bound.py): per device tier, the widest
tensor-parallel set the search may form there; per tier and group, the degree that may split
the group's compute; and which of the group's nodes a split divides.

Where the problem allows tensor parallelism (tp_moves.tp_applies: Megatron's pattern, the
analytic costs, like devices in a node), a replica may be a set of d devices of one class in
one node (tp_moves.tp_sets). The bound then has to hold for such plans too, which it does by
relaxing what a set changes (bound.py's rows take these degrees):

- a group holding a whole split region runs on each member in at least its whole nodes' time
  plus 1/d of its split nodes' (the split GEMMs are priced at the efficiency of their own,
  smaller size, cost/roofline.py; norms, embeddings, the head and the loss stay whole), which
  the one-sample chains, the average sample's chain and a replica's window use, while the
  devices' summed time stays at least the unsplit time (d members × 1/d of the split part);
- any group inside a set is computed by d devices per replica: a replica's calls may be
  fewer than the devices computing the group (y ≤ d·k), and its gradient all-reduce runs
  over the replicas, not the devices (at least (y/d − 1)·S bytes: the d sibling rings carry
  S/d each for a split group, S each for a whole one).

The NIC term needs nothing: a set stays inside one node, so each sibling ring crosses the
nodes the replicas span.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from heterog.cost.tensor_parallel import group_collectives, megatron_layout
from heterog.search.problem import Problem
from heterog.search.tp_moves import tp_applies, tp_view
from heterog.search.tp_scoring import region_spans, split_groups


@dataclass(frozen=True, slots=True)
class TpRelaxation:
    set_deg: np.ndarray  # [t] the widest set on tier t (1: none)
    split_deg: np.ndarray  # [t, g] the widest degree that may split group g there (1: none)
    split_nodes: tuple[tuple[str, ...], ...]  # per group, its nodes inside split regions (the rest stays whole)
    # per group, its split regions' all-reduces per call: (how many, their bytes: fixed, per sample)
    allreduces: tuple[tuple[int, float, float], ...] = ()
    link: tuple[tuple[float, float], ...] = ()  # per tier, (latency s, s per byte) between two devices of a node

    def allreduce_s(self, t: int, g: int, degree: int, samples: list[int]) -> list[float]:
        """Per size, the least time a member spends in group g's all-reduces split `degree` ways
        on tier t: each a ring of 2(d − 1) steps, each step at least one link's latency and
        1/d of the bytes (cost/tensor_parallel.py prices the same rings over the set's links)."""
        if degree <= 1 or not self.allreduces or not self.allreduces[g][0]:
            return [0.0] * len(samples)
        count, fixed, per_sample = self.allreduces[g]
        latency, per_byte = self.link[t]
        steps = 2 * (degree - 1)
        return [steps * (count * latency + (fixed + per_sample * m) / degree * per_byte) for m in samples]

    @property
    def allowed(self) -> bool:
        return bool(self.set_deg.max() > 1)


def tp_relaxation(prob: Problem) -> TpRelaxation:
    """What sets may do on the problem's tiers and groups: all ones (and no split nodes) where
    the problem does not allow tensor parallelism."""
    tiers = prob.tiers
    if not tp_applies(prob):
        return TpRelaxation(np.ones(len(tiers)), np.ones((len(tiers), prob.n_groups)), ((),) * prob.n_groups)
    view = tp_view(prob)
    widest = {d: len(pool) for pool in view.node_classes for d in pool}
    sets = np.array(
        [max((t for t in view.degrees if t <= max(widest.get(d, 1) for d in devs)), default=1) for devs in tiers],
        dtype=float,
    )
    names = [n.name for n in prob.graph.nodes]
    in_region = {names[i] for lo, hi in region_spans(prob) for i in range(lo, hi + 1)}
    shared = split_groups(prob)
    split_nodes = tuple(
        () if g in shared else tuple(n for n in group if n in in_region) for g, group in enumerate(prob.groups)
    )
    splits = np.array([bool(nodes) for nodes in split_nodes])
    return TpRelaxation(
        sets,
        np.where(splits[None, :], sets[:, None], 1.0),
        split_nodes,
        allreduces=_allreduces(prob, split_nodes),
        link=tuple(_inside_node(prob, devs) for devs in tiers),
    )


def _allreduces(prob: Problem, split_nodes: tuple[tuple[str, ...], ...]) -> tuple[tuple[int, float, float], ...]:
    """Per group, the all-reduces a split adds per call (cost/tensor_parallel.group_collectives,
    vocabulary whole as heterog's plans keep it): how many, and their bytes, affine in samples."""
    layout = megatron_layout(prob.graph, vocab_parallel=False)
    precision = getattr(prob.costs, "precision", "fp32")
    owner = {n: g for g, nodes in enumerate(split_nodes) for n in nodes}
    out = [[0, 0.0, 0.0] for _ in split_nodes]
    for c in group_collectives(prob.graph, layout, precision):
        g = owner.get(c.node)
        if g is not None:
            out[g][0] += 1
            out[g][1] += c.elements.fixed * c.element_bytes
            out[g][2] += c.elements.per_sample * c.element_bytes
    return tuple((int(n), f, p) for n, f, p in out)


def _inside_node(prob: Problem, devs: tuple[int, ...]) -> tuple[float, float]:
    """(latency, seconds per byte) between two devices of one of the tier's nodes; (0, 0)
    where no node holds two of them (no set there)."""
    by_node: dict[int, int] = {}
    for d in devs:
        if int(prob.node_idx[d]) in by_node:
            return prob.pair_cost(by_node[int(prob.node_idx[d])], d)
        by_node[int(prob.node_idx[d])] = d
    return 0.0, 0.0


def member_times(whole, split, degree: float, allreduce=None) -> list[float]:
    """A member's time of a group split `degree` ways, at least: the whole nodes' time plus
    1/degree of the split nodes' plus its all-reduces (each a list per batch size)."""
    extra = allreduce if allreduce is not None else [0.0] * len(whole)
    return [w - s + s / degree + a for w, s, a in zip(whole, split, extra)]
