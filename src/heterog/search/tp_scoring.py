"""Tensor-parallel strategies as the search scores them: which the simulator accepts, and
their simulation with the split inputs kept between neighbours.

A tensor-parallel plan is simulated on its first ranks with a cost model of the split graph
(simulate/tensor_parallel.py). Building that model and its caches takes tens of
milliseconds, while neighbouring strategies mostly keep the same tensor-parallel sets; so
the split graph, its cost model and a SimCache are kept per (sets, degree of each node).

What the simulator refuses, a strategy of the search may still reach by an ordinary move
(another group's `add` taking a tensor-parallel member, a `sync` move to a parameter
server): `tp_conflict` names it, and the chains score such a neighbour as rejected instead
of simulating it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from heterog.cost.tensor_parallel import megatron_layout
from heterog.errors import GraphError
from heterog.ir.kinds import SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.lower.context import SimCache
from heterog.lower.tensor_parallel import TensorParallelSupport
from heterog.search.problem import Problem, Strategy
from heterog.simulate.tensor_parallel import mirror_members, tensor_parallel_inputs

KEPT_INPUTS = 64  # split inputs kept per problem (each a split graph and its cost model's caches)


def memo(prob: Problem, key: str, make: Callable[[], Any]) -> Any:
    """A value computed once per problem (kept in its __dict__, as sharding.py keeps its caches)."""
    hit = prob.__dict__.get(key)
    if hit is None:
        hit = prob.__dict__[key] = make()
    return hit


def graph_region_spans(graph: OpGraph) -> tuple[tuple[int, int], ...]:
    """Per split region of the graph's blocks, the graph indices of its first and last node
    (column-parallel linears to row-parallel linear); () without Megatron's pattern."""
    try:
        layout = megatron_layout(graph, vocab_parallel=False)
    except GraphError:
        return ()
    index = graph.index
    out = []
    for r in layout.regions:
        at = [index[n] for n in (*r.column, *r.inner, r.row)]
        out.append((min(at), max(at)))
    return tuple(out)


def region_spans(prob: Problem) -> tuple[tuple[int, int], ...]:
    """graph_region_spans of the problem's graph, found once."""
    return memo(prob, "_tp_region_spans", lambda: graph_region_spans(prob.graph))


def split_groups(prob: Problem) -> frozenset[int]:
    """Groups that hold part of a split region another group holds too: none of them may be
    split by tensor parallelism (simulate/tensor_parallel.py check_tensor_parallel)."""

    def make() -> frozenset[int]:
        owner = {n: g for g, names in enumerate(prob.groups) for n in names}
        names = [n.name for n in prob.graph.nodes]
        out: set[int] = set()
        for lo, hi in region_spans(prob):
            held = {owner[names[i]] for i in range(lo, hi + 1) if names[i] in owner}
            if len(held) > 1:
                out |= held
        return frozenset(out)

    return memo(prob, "_tp_split_groups", make)


def tp_conflict(prob: Problem, s: Strategy) -> str | None:
    """Why strategy `s` cannot be a tensor-parallel plan of this problem, or None (also for a
    strategy without tensor parallelism): a split group that shares a block's region with
    another group, a sync other than ring (sibling rings are all the cost model prices
    between sets), a device in two different sets (or in a set and alone) — the simulator
    refuses these — or, where the problem allows one degree only (a plan to be run:
    lower/tensor_parallel.py runnable), groups at different degrees."""
    if not any(p.tp for p in s.placements):
        return None
    if prob.tensor_parallel == TensorParallelSupport.UNIFORM and len({p.tp_degree for p in s.placements}) > 1:
        return "the groups have different tensor-parallel degrees, and a run takes one degree for every group"
    cut = split_groups(prob)
    sets: dict[int, tuple[int, ...]] = {}
    for g, p in enumerate(s.placements):
        if p.tp and g in cut:
            return f"group {g} shares a split region with another group"
        if len(p.devices) > 1 and p.sync != SyncMethod.RING:
            return f"group {g} syncs by {p.sync}, not ring"
        for i, d in enumerate(p.devices):
            members = (d, *p.tp[i]) if p.tp else (d,)
            for m in members:
                if sets.setdefault(m, members) != members:
                    return f"device {prob.device_names[m]} is in two tensor-parallel sets"
    return None


def simulated(prob: Problem, plan: Plan, sim: Callable) -> Any:
    """`sim` (the simulator) on `plan` with the problem's caches: for a tensor-parallel plan
    the split inputs of its sets are kept (module docstring) and the members mirrored as
    simulate() does it."""
    if not plan.tensor_parallel:
        return sim(prob.graph, prob.cluster, plan, prob.costs, timeline=False, cache=prob.sim_cache)
    kept: dict[tuple, tuple] = memo(prob, "_tp_inputs", dict)
    degrees = sorted({g.tp_degree for g in plan.groups})
    key = (
        tuple(sorted({r.members for g in plan.groups for r in g.replicas})),
        # what tensor_parallel_inputs reads: the widest degree, and each node's where they differ
        # (not each group's: the megatron-3d grid's plan and the search's have other groups)
        degrees[-1] if len(degrees) == 1 else tuple(sorted((n, g.tp_degree) for g in plan.groups for n in g.nodes)),
    )
    hit = kept.get(key)
    if hit is None:
        split, _, tp_costs = tensor_parallel_inputs(prob.graph, prob.cluster, plan, prob.costs)
        if len(kept) >= KEPT_INPUTS:
            kept.clear()
        hit = kept[key] = (split, split.fingerprint(), tp_costs, SimCache())
    split, fingerprint, tp_costs, cache = hit
    # simulate/tensor_parallel.py first_ranks, with the split graph's fingerprint kept
    first = tuple(
        dataclasses.replace(g, replicas=tuple(dataclasses.replace(r, tp_devices=()) for r in g.replicas))
        for g in plan.groups
    )
    on_split = dataclasses.replace(plan, groups=first, graph_fingerprint=fingerprint)
    result = sim(split, prob.cluster, on_split, tp_costs, timeline=False, cache=cache)
    capacity = {d: prob.cluster.memory_bytes(d) for d in plan.devices()}
    return mirror_members(result, plan, tp_costs, capacity)
