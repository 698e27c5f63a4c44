"""simulate(graph, cluster, plan, costs) -> SimResult: one training iteration under a Plan.

The simulator keeps no schedule rules: the lowering stage builds the iteration's tasks and
their order (heterog.lower.schedule, the same schedule the executor's Program is written from),
and this module puts times on it (engine.run) and summarises (SimResult).

What is modelled, and what is not:
- compute: the cost model's uncontended times; communication overlaps compute fully (NCCL's
  own stream) and does not slow it down (SM and memory-bandwidth sharing are not modelled);
- links: FIFO and exclusive in a fixed order (engine.py), so contention serialises transfers
  and collectives on shared NICs; a collective holds all links of its ring for its whole time;
- memory: parameters, optimizer state, gradients (from the first backward on), activations
  from a micro-batch's forward to its backward (group by group inside a block), workspace,
  received tensors until read, gradient buckets while synchronised, and the input batch.
  Allocator fragmentation and the CUDA context are not counted.
Shortcuts that do not change the answer (tests compare with them switched off): symmetric
devices are simulated once, equal-sized micro-batches are copied.
"""

from __future__ import annotations

import gc

import numpy as np

from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.lower.context import SimCache
from heterog.lower.schedule import Schedule, build_schedule
from heterog.lower.taskgraph import KIND_NAMES, OPT, SYNC, XFER
from heterog.simulate import engine
from heterog.simulate.result import SimEvent, SimResult, Traffic
from heterog.simulate.tensor_parallel import collective_events, mirror_members, tensor_parallel_inputs


def simulate(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, *, timeline: bool = True, cache: SimCache | None = None
) -> SimResult:
    """Simulate one iteration. `timeline=False` skips the memory timeline (the search's
    setting; events are built lazily either way). `cache`: the caller's SimCache, kept across
    calls that share graph, cluster and costs (the search's); a fresh one otherwise."""
    # The task graph is tens of thousands of small acyclic lists, freed by reference counting;
    # the cyclic collector would scan them (and the caches) over and over: ~30% of the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        if plan.tensor_parallel:  # simulated on first ranks (simulate/tensor_parallel.py)
            split, on_split, tp_costs = tensor_parallel_inputs(graph, cluster, plan, costs)
            sched = build_schedule(split, cluster, on_split, tp_costs)
            result = time_schedule(sched, timeline=timeline)
            capacity = {d: cluster.memory_bytes(d) for d in plan.devices()}
            return mirror_members(result, plan, tp_costs, capacity, collectives=collective_events(sched, tp_costs))
        sched = build_schedule(graph, cluster, plan, costs, cache=cache)
        return time_schedule(sched, timeline=timeline)
    finally:
        if enabled:
            gc.enable()


def time_schedule(sched: Schedule, *, timeline: bool = True) -> SimResult:
    """Put times on a schedule: the timed run with link contention and memory → SimResult."""
    info, tasks = sched.info, sched.tasks
    start, end, peak, overflow, mem_trace = engine.run(tasks, sched.order, info, timeline)
    return _result(sched.plan, info, tasks, start, end, peak, overflow, mem_trace)


def _result(plan, info, tasks, start, end, peak, overflow, mem_trace) -> SimResult:
    device_sets = {b.device_set: b.devices for b in tasks.blocks}  # a few distinct ones
    used = sorted(set().union(*device_sets.values()) | {b.ps_device for b in tasks.blocks if b.ps_device is not None})
    names = info.devices
    iteration = max(end) if end else 0.0
    compute = {d: 0.0 for d in used}
    # per-device sums of compute time in task order (bincount adds in index order, like a loop)
    dev_a = tasks.array("dev")
    on_dev = dev_a >= 0
    per_dev = np.bincount(dev_a[on_dev], weights=tasks.array("dur")[on_dev], minlength=len(names)).tolist()
    for d in compute:
        compute[d] += per_dev[d]
    rep = tasks.rep
    for d in used:  # devices simulated through a representative share its timeline
        r = rep[d]
        if r != d:
            compute[d] = compute[r]
            peak[d] = peak[r]
            if mem_trace:
                mem_trace[d] = mem_trace[r]
    over_dev = names[overflow[0]] if overflow else None
    over_bytes = int(peak[overflow[0]] - info.capacity_bytes[overflow[0]]) if overflow else 0
    return SimResult(
        iteration_time_s=iteration,
        throughput_samples_per_s=plan.batch_size / iteration if iteration > 0 else float("inf"),
        batch_size=plan.batch_size,
        feasible=overflow is None,
        peak_memory_bytes={names[d]: int(peak[d]) for d in used},
        memory_capacity_bytes={names[d]: int(info.capacity_bytes[d]) for d in used},
        persistent_memory_bytes={names[d]: int(tasks.persistent_bytes[d]) for d in used},
        overflow_device=over_dev,
        overflow_bytes=over_bytes,
        compute_time_s={names[d]: compute[d] for d in used},
        idle_time_s={names[d]: max(iteration - compute[d], 0.0) for d in used},
        num_tasks=len(tasks.dur),
        memory_timeline={names[d]: tuple(mem_trace[d]) for d in used} if mem_trace else {},
        timeline_source=lambda: _events(tasks, info, start, end),
        traffic_source=lambda: _traffic(tasks, info, used),
    )


def _traffic(tasks, info, used: list[int]) -> Traffic:
    """Per device the time of its communication, per link its bytes and busy time."""
    comm = {d: 0.0 for d in used}
    if tasks.comm:
        members = info.member_sets
        sets = members.ids([v[0] for v in tasks.comm.values()])
        ids = np.fromiter(tasks.comm, dtype=np.int64, count=len(tasks.comm))
        for d, x in _per_element(members, sets, tasks.array("dur")[ids]).items():
            comm[d] += x
    comm_ids, sets = engine.comm_link_sets(tasks, info)
    busy = _per_element(info.link_sets, sets, tasks.array("dur")[comm_ids])
    names = info.devices
    return Traffic(
        communication_time_s={names[d]: comm[d] for d in used},
        link_bytes={info.links[link]: b for link, b in sorted(_link_bytes(tasks, info).items())},
        link_busy_time_s={info.links[link]: b for link, b in busy.items()},
    )


def _link_bytes(tasks, info) -> dict[int, float]:
    """Bytes per link: every transfer's on the links of its path, then each collective's
    load (bytes per buffer byte) times its buffer, summed per distinct load map first."""
    xfers = list(tasks.xfer_blocks)
    sets = info.link_sets.ids([tasks.links[t] for t in xfers])
    out = _per_element(info.link_sets, sets, np.array([tasks.comm[t][1] for t in xfers], dtype=np.float64))
    per_load: dict[int, list] = {}
    for s, load in tasks.sync_loads.items():
        per_load.setdefault(id(load), [load, 0.0])[1] += tasks.comm[s][1]
    for load, nbytes in per_load.values():
        for link, share in load.items():
            out[link] = out.get(link, 0.0) + share * nbytes
    return out


def _per_element(registry, sets: np.ndarray, weights: np.ndarray) -> dict[int, float]:
    """Per element (link, device) of the numbered sets that tasks hold (in task order), the
    sum of the tasks' weights: per set first, then per element in the order the sets first
    appear — the order of the sums is part of the result."""
    if not len(sets):
        return {}
    uniq, first, inv = np.unique(sets, return_index=True, return_inverse=True)
    per_set = np.bincount(inv, weights=weights)
    order = np.argsort(first)
    elements, count = registry.gather(uniq[order], registry.ALL)
    total = np.bincount(elements, weights=np.repeat(per_set[order], count))
    held = np.unique(elements)
    return dict(zip(held.tolist(), total[held].tolist()))


def _events(tasks, info, start, end):
    names, links = info.devices, info.links
    blocks = tasks.blocks
    twins: dict[int, list[int]] = {}
    for d, r in enumerate(tasks.rep):
        if r != d:
            twins.setdefault(r, [r]).append(d)
    for t, k in enumerate(tasks.kind):
        s, e = start[t], end[t]
        if k == OPT:
            for d in twins.get(tasks.dev[t], (tasks.dev[t],)):
                yield SimEvent("optimizer step", "optimizer", names[d], s, e, t)
            continue
        blk = blocks[tasks.block_of(t)]
        if k == XFER:
            a, b = tasks.comm[t][0]
            label = f"{blk.label} mb{tasks.mb[t]} {names[a]}→{names[b]}"
        elif k == SYNC:
            tie, shard = tasks.ties.get(t), tasks.shard_ops.get(t)
            label = f"tied {tie} sync" if tie else f"{blk.label} {blk.sync} sync"
            if shard is not None:  # a sharded block's reduce-scatter or gather (lower/shard_tasks.py)
                label = f"{blk.label} {shard.primitive}" + (
                    f" {shard.phase} mb{shard.microbatch}" if shard.phase else ""
                )
        else:
            label = f"{blk.label} {'F' if k == 0 else 'B'} mb{tasks.mb[t]}"
        cat = KIND_NAMES[k]
        if tasks.dev[t] >= 0:
            for d in twins.get(tasks.dev[t], (tasks.dev[t],)):
                yield SimEvent(label, cat, names[d], s, e, t)
            continue
        for m in tasks.comm[t][0]:
            yield SimEvent(label, cat, names[m], s, e, t)
        for link in tasks.links[t]:
            yield SimEvent(label, cat, f"link:{links[link]}", s, e, t)
