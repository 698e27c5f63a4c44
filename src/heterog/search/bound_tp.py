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

from heterog.search.problem import Problem
from heterog.search.tp_moves import tp_applies, tp_view
from heterog.search.tp_scoring import region_spans, split_groups


@dataclass(frozen=True, slots=True)
class TpRelaxation:
    set_deg: np.ndarray  # [t] the widest set on tier t (1: none)
    split_deg: np.ndarray  # [t, g] the widest degree that may split group g there (1: none)
    split_nodes: tuple[tuple[str, ...], ...]  # per group, its nodes inside split regions (the rest stays whole)

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
    return TpRelaxation(sets, np.where(splits[None, :], sets[:, None], 1.0), split_nodes)


def member_times(whole: list[float], split: list[float], degree: float) -> list[float]:
    """A member's time of a group split `degree` ways, at least: the whole nodes' time plus
    1/degree of the split nodes' (each list per batch size)."""
    return [w - s + s / degree for w, s in zip(whole, split)]
