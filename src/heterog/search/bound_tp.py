"""What tensor parallelism may do, for the lower bound (bound.py): per device tier, the widest
tensor-parallel set the search may form there and the devices of one such set; per tier and
group, the degree that may split the group's compute; which of the group's nodes a split
divides; and a member's time as the simulator prices it.

Where the problem allows tensor parallelism (tp_moves.tp_applies: Megatron's pattern, the
analytic costs, like devices in a node), a replica may be a set of d devices of one class in
one node (tp_moves.tp_sets). The bound then has to hold for such plans too, which it does by
relaxing what a set changes (bound.py's rows take these degrees):

- a group split d ways runs on each member in its slice's time: the cost model of one rank
  (cost/tensor_parallel.TensorParallelCostModel, as simulate/tensor_parallel.py builds it) on
  a set of the tier, its smaller GEMMs at their own efficiency and its per-block all-reduces
  over the set's links — the time the simulator gives that member's calls. The one-sample
  chains, the average sample's chain and a replica's window take the least of it over the
  degrees a tier allows (one of them 1, unsplit), while the devices' summed time stays at
  least the unsplit time (d members, each at least 1/d of the split part);
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

from heterog.cost.tensor_parallel import DEGREES, TensorParallelCostModel
from heterog.ir.kinds import Phase
from heterog.search.problem import Problem
from heterog.search.tp_moves import tp_applies, tp_view
from heterog.search.tp_scoring import memo, region_spans, split_groups


@dataclass(frozen=True, slots=True)
class TpRelaxation:
    set_deg: np.ndarray  # [t] the widest set on tier t (1: none)
    split_deg: np.ndarray  # [t, g] the widest degree that may split group g there (1: none)
    split_nodes: tuple[tuple[str, ...], ...]  # per group, its nodes inside split regions (the rest stays whole)
    sets: tuple[tuple[str, ...], ...] = ()  # per tier, the devices of a widest set in one of its nodes, rank order

    @property
    def allowed(self) -> bool:
        return bool(self.set_deg.max() > 1)

    def degrees(self, t: int, g: int) -> list[int]:
        """The degrees a replica of group g may have on tier t, 1 (unsplit) first."""
        return [d for d in DEGREES if d <= self.split_deg[t, g]]

    def member_s(self, prob: Problem, t: int, g: int, degree: int, samples: list[int]) -> list[tuple[float, float]]:
        """Per size, (forward, backward) of group g on a member of a tier-t set splitting it
        `degree` ways: one rank's slice with its all-reduces (the module docstring); the
        problem's own times where degree is 1."""
        names = prob.groups[g]
        if degree == 1:
            table = prob.sim_cache.cost_table(prob.graph, prob.costs)
            rep = prob.device_names[prob.tiers[t][0]]
            return [table.times_s(tuple(names), rep, b) for b in samples]
        # a tier's devices are alike and so are its nodes' links (Problem.pair_cost): one set serves
        members = self.sets[t][:degree]
        costs = memo(
            prob, f"_bound_tp:{degree}", lambda: _rank_costs(prob, [s[:degree] for s in self.sets if len(s) >= degree])
        )
        return [
            (
                costs.group_time_s(names, members[0], b, Phase.FORWARD),
                costs.group_time_s(names, members[0], b, Phase.BACKWARD),
            )
            for b in samples
        ]


def _rank_costs(prob: Problem, sets: list[tuple[str, ...]]) -> TensorParallelCostModel:
    """The cost model of the first ranks of `sets` (all of one degree), as
    simulate/tensor_parallel.py builds it for a plan (the vocabulary whole, the problem's
    precision and optimizer): one split graph for every tier."""
    return TensorParallelCostModel(
        prob.graph,
        prob.cluster,
        degree=len(sets[0]),
        groups={members[0]: members for members in sets},
        precision=prob.precision,
        optimizer=prob.optimizer,
        vocab_parallel=False,
    )


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
        sets=tuple(_widest_set(prob, devs, int(d)) for devs, d in zip(tiers, sets)),
    )


def _widest_set(prob: Problem, devs: tuple[int, ...], degree: int) -> tuple[str, ...]:
    """`degree` devices of the tier in its first node that has them (tp_moves.tp_sets keeps a
    set inside one node), in index order; none where degree is 1."""
    if degree <= 1:
        return ()
    by_node: dict[int, list[int]] = {}
    for d in devs:
        by_node.setdefault(int(prob.node_idx[d]), []).append(d)
    pool = next(sorted(p) for p in by_node.values() if len(p) >= degree)
    return tuple(prob.device_names[d] for d in pool[:degree])
