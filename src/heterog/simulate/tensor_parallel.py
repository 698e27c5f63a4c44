"""A tensor-parallel plan as the simulator prices it: one rank of each tensor-parallel replica.

A replica with `tp_devices` splits its group's transformer blocks Megatron-style over its
members (ir/plan.py). Its members run the same slice of every node at the same time, so the
iteration is simulated on the first ranks, priced by `TensorParallelCostModel`
(cost/tensor_parallel.py): one rank's split graph, the per-block all-reduces over the
members' own links added to the node they follow (Megatron v1 runs them on the compute stream),
gradient syncs and stage-to-stage sends as the t sibling rings (or sends) that run at once.
Every member's memory and compute time is its first rank's: the slices are alike.

Stages may differ in degree (the cost model splits each node at its group's degree; a send
between sets of different sizes gives every rank of the larger set a whole copy).

The per-block all-reduces are part of a compute task's time, not tasks of their own (Megatron
runs them on the compute stream, inside the forward and backward); the timeline shows them as
`tp all-reduce` events at the end of each compute they belong to (`collective_events`), in
the communication lane.

Limits:
the analytic cost model prices the slices (a measured profile of the unsplit nodes does not
describe them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from heterog.cost.analytic import AnalyticCostModel
from heterog.cost.tensor_parallel import TensorParallelCostModel, megatron_layout
from heterog.errors import GraphError, PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan, split_samples
from heterog.simulate.result import SimEvent, SimResult, Traffic


def check_tensor_parallel(graph: OpGraph, plan: Plan) -> None:
    """Refuse a plan whose tensor-parallel groups the graph cannot split: no transformer
    block of Megatron's pattern, or a block's split region cut between groups."""
    if not plan.tensor_parallel:
        return
    try:
        layout = megatron_layout(graph)
    except GraphError as e:
        raise PlanError(f"the plan splits groups by tensor parallelism, but {e}") from None
    owner = {n: g.name for g in plan.groups for n in g.nodes}
    for r in layout.regions:
        names = (r.norm, *r.column, *r.inner, r.row)
        held = sorted({owner[n] for n in names[1:] if n in owner})
        if len(held) > 1 and any(g.tp_degree > 1 for g in plan.groups if g.name in held):
            raise PlanError(
                f"the split region from {r.column[0]!r} to {r.row!r} lies in groups {held}; a tensor-parallel "
                f"group must hold each column-parallel linear with its row-parallel partner. Put a block's "
                f"nodes in one group."
            )


def tensor_parallel_inputs(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs
) -> tuple[OpGraph, Plan, TensorParallelCostModel]:
    """The split graph, the plan on its first ranks and the cost model of one rank per replica."""
    plan.validate(graph, cluster)
    check_tensor_parallel(graph, plan)
    degrees = sorted({g.tp_degree for g in plan.groups})
    if type(costs) is not AnalyticCostModel:
        raise PlanError(
            f"a tensor-parallel plan is priced by the analytic cost model of its slices, but the costs given "
            f"are a {type(costs).__name__} (measured profiles of the unsplit nodes); simulate it without profiles."
        )
    groups: dict[str, tuple[str, ...]] = {}
    for g in plan.groups:
        for r in g.replicas:
            if groups.setdefault(r.device, r.members) != r.members:
                raise PlanError(
                    f"device {r.device!r} leads two tensor-parallel sets ({list(groups[r.device])} and "
                    f"{list(r.members)}); a device's set must be the same in every group."
                )
    tp = TensorParallelCostModel(
        graph,
        cluster,
        degree=degrees[-1],
        groups=groups,
        precision=plan.precision,
        optimizer=plan.optimizer,
        vocab_parallel=False,  # the executor keeps the embedding and head whole (execute/tp_split.py)
        node_degrees={n: g.tp_degree for g in plan.groups for n in g.nodes} if len(degrees) > 1 else None,
    )
    return tp.graph, first_ranks(plan, tp.graph), tp


def first_ranks(plan: Plan, split: OpGraph) -> Plan:
    """The plan on each replica's first rank, for the split graph."""
    groups = tuple(
        dataclasses.replace(g, replicas=tuple(dataclasses.replace(r, tp_devices=()) for r in g.replicas))
        for g in plan.groups
    )
    return dataclasses.replace(plan, groups=groups, graph_fingerprint=split.fingerprint())


def tensor_parallel_time_s(plan: Plan, costs: TensorParallelCostModel) -> dict[str, float]:
    """Per first rank, the time of its per-block all-reduces in one iteration (part of its
    compute time: Megatron runs them on the compute stream)."""
    out: dict[str, float] = {}
    for g in plan.groups:
        for m in range(plan.num_microbatches):
            for r, samples in zip(g.replicas, plan.replica_samples(g, m), strict=True):
                t = costs.group_collectives_time_s(g.nodes, r.device, samples)
                out[r.device] = out.get(r.device, 0.0) + t
    return out


def collective_events(sched, costs: TensorParallelCostModel) -> Callable[[Sequence[SimEvent]], list[SimEvent]]:
    """From a first-rank schedule's events, each compute's tensor-parallel all-reduces as an
    event of their own: the last part of the compute (op −1: no Program instruction of its own)."""
    tasks, plan, names = sched.tasks, sched.plan, sched.info.devices
    ids = {n: i for i, n in enumerate(names)}
    sizes = [plan.microbatch_size(m) for m in range(plan.num_microbatches)]

    def events(computed: Sequence[SimEvent]) -> list[SimEvent]:
        out = []
        for e in computed:
            if e.category not in (Phase.FORWARD, Phase.BACKWARD) or e.op < 0 or e.track not in ids:
                continue
            blk = tasks.blocks[tasks.block_of(e.op)]
            if ids[e.track] not in blk.devices:
                continue
            samples = split_samples(sizes[tasks.mb[e.op]], list(blk.shares))[blk.devices.index(ids[e.track])]
            phases = (Phase(e.category),)
            t = sum(costs.group_collectives_time_s(nodes, e.track, samples, phases) for nodes in blk.nodes)
            if t > 0:
                out.append(
                    SimEvent(f"{e.name} tp all-reduce", TP_CATEGORY, e.track, max(e.start_s, e.end_s - t), e.end_s, -1)
                )
        return out

    return events


TP_CATEGORY = "tp"  # the timeline's category of a compute's tensor-parallel all-reduces


def mirror_members(
    result: SimResult,
    plan: Plan,
    costs: TensorParallelCostModel,
    capacity: dict[str, int],
    *,
    op_stride: int = 0,
    collectives: Callable[[Sequence[SimEvent]], list[SimEvent]] | None = None,
) -> SimResult:
    """`result` (simulated on first ranks) with every member given its first rank's memory,
    compute, idle and communication time (the last with its per-block all-reduces) and
    timeline, and the feasibility of each member's own memory. op_stride: member k's events
    carry op + k × op_stride, as its Program instructions do (lower/tensor_parallel.py);
    collectives: the first ranks' tensor-parallel all-reduce events (collective_events)."""
    first = {m: r.device for g in plan.groups for r in g.replicas for m in r.members}
    index = {m: k for g in plan.groups for r in g.replicas for k, m in enumerate(r.members)}
    peak = {d: result.peak_memory_bytes[first[d]] for d in first}
    over = [(peak[d] - capacity[d], d) for d in peak if peak[d] > capacity[d]]
    worst = max(over) if over else None
    tp_time = tensor_parallel_time_s(plan, costs)

    def traffic() -> Traffic:
        t = result._traffic_of()
        comm = {d: t.communication_time_s.get(first[d], 0.0) + tp_time.get(first[d], 0.0) for d in first}
        return dataclasses.replace(t, communication_time_s=comm)

    def events() -> list[SimEvent]:
        firsts = list(result.events) + (collectives(result.events) if collectives is not None else [])
        others: dict[str, list[str]] = {}  # each first rank's other members
        for m, lead in first.items():
            if m != lead:
                others.setdefault(lead, []).append(m)
        out = list(firsts)
        for e in firsts:
            out += [
                e._replace(track=m, op=e.op + index[m] * op_stride if e.op >= 0 else e.op)
                for m in others.get(e.track, ())
            ]
        return out

    return dataclasses.replace(
        result,
        peak_memory_bytes=peak,
        persistent_memory_bytes={d: result.persistent_memory_bytes[first[d]] for d in first},
        memory_timeline={d: result.memory_timeline[first[d]] for d in first if first[d] in result.memory_timeline},
        compute_time_s={d: result.compute_time_s[first[d]] for d in first},
        idle_time_s={d: result.idle_time_s[first[d]] for d in first},
        memory_capacity_bytes={d: capacity[d] for d in first},
        feasible=not over,
        overflow_device=worst[1] if worst else None,
        overflow_bytes=int(worst[0]) if worst else 0,
        timeline_source=events,
        traffic_source=traffic,
        _built=[],
        _traffic=[],
    )
