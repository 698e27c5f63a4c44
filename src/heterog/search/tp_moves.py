"""Tensor parallelism in the search: the move that splits a segment's replicas into
tensor-parallel sets, the grouping that keeps every split region in one group, and
Megatron's best uniform grid plan as a candidate and a start.

The move (`tp`, registered with moves.register_move) turns a segment's replicas into sets of
degree 2, 4 or 8 over devices of one node and one class — Megatron keeps a tensor-parallel
group inside a node, where the links are fastest (Narayanan et al., SC'21, §3.3) — or
changes a set's degree, or undoes it; the batch-share LP (shares.py) re-balances the set
leaders. It is drawn only where the problem allows tensor parallelism (`Problem.tensor_parallel`:
where the plan is to be run, what lower/tensor_parallel.py `executor_tensor_parallel` says; one
degree for every group moves every segment at once),
the graph has Megatron's pattern, the costs are the analytic model whose split the simulator
prices, and some node has two like devices. Its neighbours are scored by the simulator only
(tp_scoring.py; the group-level estimate does not model the split).

The simulator refuses a tensor-parallel group that holds part of a block's split region
(simulate/tensor_parallel.py), so where the search may split groups the grouping moves each
region whole into the group holding most of it (`whole_regions`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from heterog.cost.analytic import AnalyticCostModel
from heterog.cost.tensor_parallel import DEGREES
from heterog.errors import GraphError, PlanError
from heterog.ir.kinds import SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.lower.tensor_parallel import TensorParallelSupport
from heterog.search.lanes import Candidate
from heterog.search.moves import Move, MoveContext, MoveScope, register_move, reshaped, segments, with_placement
from heterog.search.problem import Placement, Problem, Strategy
from heterog.search.shares import balanced_shares
from heterog.search.three_d import best_uniform, check_divides, grid
from heterog.search.tp_scoring import graph_region_spans, memo, region_spans, simulated, split_groups
from heterog.simulate.simulator import simulate

GRID_NAME = "megatron-3d"
# the tp move's weight beside the registry's others (29 in all, moves.py): about one move in eight
TP_MOVE_WEIGHT = 4.0
# a split plan's first simulation in baseline simulations: it builds the split graph and its
# cost tables (5–7 measured: a megatron-3d plan of bert-large on 64 and on 1024 devices)
SPLIT_PLAN_CALLS = 8


def whole_regions(graph: OpGraph, costs, groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """`groups` with every split region of the graph's blocks moved whole into the group that
    holds most of it, so that any group can be split by tensor parallelism; unchanged where
    the tp move is never drawn (no Megatron pattern, or costs the split is not priced with).
    Groups are contiguous in graph order and a region's span is moved as a unit, so every
    edge between groups still points forward."""
    spans = graph_region_spans(graph) if type(costs) is AnalyticCostModel else ()
    if not spans:
        return [tuple(g) for g in groups]
    index = graph.index
    owner = [0] * len(graph.nodes)
    for g, names in enumerate(groups):
        for n in names:
            owner[index[n]] = g
    for lo, hi in spans:
        held = owner[lo : hi + 1]
        if len(set(held)) > 1:
            owner[lo : hi + 1] = [Counter(held).most_common(1)[0][0]] * (hi - lo + 1)
    out: list[list[str]] = [[] for _ in groups]
    for i, node in enumerate(graph.nodes):
        out[owner[i]].append(node.name)
    # groups the cut's rules made non-contiguous (a data-free node runs with its consumers, such
    # as Llama's rotary tables) can turn an edge backward when a span moves: keep them as they were
    if any(owner[index[s]] < owner[i] for i, n in enumerate(graph.nodes) for s in graph.successors[n.name]):
        return [tuple(g) for g in groups]
    return [tuple(g) for g in out if g]


@dataclass(frozen=True, kw_only=True, slots=True)
class TpView:
    """What the tp move needs of a problem: the degrees the model and the nodes allow, and
    each node's devices by class, nodes with the fastest links first."""

    degrees: tuple[int, ...]
    node_classes: tuple[tuple[int, ...], ...]  # devices of one node and one class, in index order


def tp_view(prob: Problem) -> TpView:
    def make() -> TpView:
        by_node: dict[tuple[int, int], list[int]] = {}
        for d in range(prob.n_devices):
            by_node.setdefault((int(prob.node_idx[d]), int(prob.dev_class[d])), []).append(d)
        pools = [tuple(v) for v in by_node.values() if len(v) > 1]
        pools.sort(key=lambda v: (prob.pair_cost(v[0], v[1])[1], v[0]))  # seconds per byte inside the node
        widest = max((len(v) for v in pools), default=1)
        degrees = tuple(t for t in DEGREES if 1 < t <= widest and _divides(prob, t))
        return TpView(degrees=degrees, node_classes=tuple(pools))

    return memo(prob, "_tp_view", make)


def _divides(prob: Problem, degree: int) -> bool:
    """Whether `degree` divides the model's heads and split features (three_d.check_divides)."""
    if prob.model_spec is None:  # the heads are read from the model's spec: without one, no split
        return False
    try:
        check_divides(prob.graph, prob.model_spec, degree)
    except (PlanError, GraphError):
        return False
    return True


def tp_applies(prob: Problem) -> bool:
    """The tp move's problems (module docstring)."""
    allowed = prob.tensor_parallel != TensorParallelSupport.NONE
    if not allowed or prob.model_spec is None or type(prob.costs) is not AnalyticCostModel:
        return False
    if not region_spans(prob):
        return False
    return bool(tp_view(prob).degrees) and len(split_groups(prob)) < prob.n_groups


def tp_sets(prob: Problem, devices: Sequence[int], degree: int, busy: set[int]) -> list[tuple[int, ...]]:
    """Sets of `degree` devices, each inside one node and one class: per pool of like devices
    (fastest links first), the given devices there, completed with the pool's free ones (not
    `busy`) to whole sets; what cannot fill a set is left out."""
    given = set(devices)
    out: list[tuple[int, ...]] = []
    for pool in tp_view(prob).node_classes:
        mine = [d for d in pool if d in given]
        if not mine:
            continue
        free = [d for d in pool if d not in given and d not in busy]
        need = -len(mine) % degree
        members = mine + free[:need] if need <= len(free) else mine
        out += [tuple(members[k : k + degree]) for k in range(0, len(members) - degree + 1, degree)]
    return out


def tp_move(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The segment [a, b) split by tensor parallelism at another degree, or not split (its
    members become replicas); where the problem allows one degree only, every segment alike."""
    prob, p = ctx.prob, s.placements[a]
    choices = [t for t in tp_view(prob).degrees if t != p.tp_degree] + ([1] if p.tp else [])
    if not choices:
        return s
    degree = ctx.rng.choice(choices)
    if prob.tensor_parallel != TensorParallelSupport.UNIFORM:
        return at_degree(prob, s, a, b, degree)
    out = s
    for lo, hi in segments(s):
        out = at_degree(prob, out, lo, hi, degree)
    return out if all(q.tp_degree == degree for q in out.placements) else s


def at_degree(prob: Problem, s: Strategy, a: int, b: int, degree: int) -> Strategy:
    """The segment [a, b) as tensor-parallel sets of `degree` over its members (1: the members
    as replicas); shares from the LP over the sets' first devices; `s` where no set forms."""
    p = s.placements[a]
    if any(g in split_groups(prob) for g in range(a, b)):
        return s
    members = [m for i, d in enumerate(p.devices) for m in ((d, *p.tp[i]) if p.tp else (d,))]
    if degree == 1:
        return reshaped(prob, s, a, b, members, SyncMethod.RING, None, p.recompute) if p.tp else s
    busy = {
        d
        for g, q in enumerate(s.placements)
        if not a <= g < b
        for i, x in enumerate(q.devices)
        for d in (x, *(q.tp[i] if q.tp else ()))
    }
    sets = tp_sets(prob, members, degree, busy)
    if not sets:
        return s
    rest = {x[0]: x[1:] for x in sets}
    devs, shares = balanced_shares(prob, range(a, b), sorted(rest), microbatches=s.microbatches, recompute=p.recompute)
    sync = SyncMethod.RING if len(devs) > 1 else SyncMethod.NONE
    tp = tuple(rest[d] for d in devs)
    return with_placement(s, a, b, Placement(devs, shares, sync, None, p.recompute, tp=tp))


register_move(Move(name="tp", weight=TP_MOVE_WEIGHT, scope=MoveScope.ANY, apply=tp_move, when=tp_applies))


def strategy_of(prob: Problem, plan: Plan) -> Strategy:
    """A plan on this problem's devices (a 3d plan of its cluster) as a strategy of its
    groups: each group takes the placement of the plan's group holding most of its nodes."""
    index = {d: i for i, d in enumerate(prob.device_names)}
    owner = {n: g for g in plan.groups for n in g.nodes}
    placements = []
    for names in prob.groups:
        votes = Counter(owner[n].name for n in names)
        group = next(g for g in plan.groups if g.name == votes.most_common(1)[0][0])
        replicas = sorted(group.replicas, key=lambda r: index[r.device])
        devs = tuple(index[r.device] for r in replicas)
        tp = tuple(tuple(index[m] for m in r.tp_devices) for r in replicas) if group.tp_degree > 1 else ()
        sync = SyncMethod.RING if len(devs) > 1 else SyncMethod.NONE
        placements.append(Placement(devs, tuple(r.share for r in replicas), sync, None, group.recompute, tp=tp))
    m = plan.num_microbatches if prob.batch_size % plan.num_microbatches == 0 else 1
    return Strategy(tuple(placements), m, plan.schedule, plan.bucket_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class GridBaseline:
    """The megatron-3d candidate and its plan as a start of the search (None when skipped),
    and what the planner reports: how many configurations were scored, of how many, in how
    long, or why none was."""

    candidate: Candidate | None
    start: Strategy | None
    report: dict[str, Any]


def megatron_baseline(prob: Problem, until_s: float, per_call_s: float) -> GridBaseline | None:
    """Megatron's best uniform tp × pp × dp plan (three_d.best_uniform: its grid scored by the
    simulator until `until_s`, configurations whose state fits first; tensor parallelism only
    where the problem allows it), as a candidate and as a start of the search. None for a
    model without transformer blocks (or without its spec); skipped, saying so, when a split
    plan's first simulation, SPLIT_PLAN_CALLS at a baseline's cost (`per_call_s`), does not
    fit before `until_s` (a thousand devices at a small budget)."""
    if prob.model_spec is None or not region_spans(prob):
        return None
    degrees = (1, *tp_view(prob).degrees) if tp_applies(prob) else (1,)
    every = grid(prob.graph, prob.cluster, prob.model_spec, degrees=degrees)
    if not every:
        return None
    t0 = time.perf_counter()
    if until_s - t0 < SPLIT_PLAN_CALLS * per_call_s:
        why = (
            f"skipped: a split plan's first simulation ({SPLIT_PLAN_CALLS} × {per_call_s:.2g} s) exceeds its share "
            f"of the budget ({until_s - t0:.2g} s)"
        )
        return GridBaseline(candidate=None, start=None, report={"of": len(every), "skipped": why})
    ranked = best_uniform(
        prob.graph,
        prob.cluster,
        prob.costs,
        prob.model_spec,
        deadline_s=until_s,
        precision=prob.precision,
        optimizer=prob.optimizer,
        degrees=degrees,
        score=lambda plan: simulated(prob, plan, simulate),
    )
    best = ranked[0]
    made = Candidate(
        strategy=GRID_NAME,
        plan=best.plan,
        iteration_time_s=best.iteration_time_s,
        feasible=best.feasible,
        peak_memory_bytes=dict(best.plan.predicted_peak_memory_bytes),
        scored_by="simulator",
    )
    report = {"scored": len(ranked), "of": len(every), "time_s": time.perf_counter() - t0}
    return GridBaseline(candidate=made, start=strategy_of(prob, best.plan), report=report)
