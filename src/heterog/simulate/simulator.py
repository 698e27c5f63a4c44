"""simulate(graph, cluster, plan, costs) -> SimResult: one training iteration under a Plan.

Pipeline (each step one function): check the plan against graph and cluster → order the
groups by the plan's priorities → fuse same-placement runs into blocks/buckets
(blocks.make_blocks) → expand into tasks (tasks.expand) → fix each device's and link's order
by list scheduling (engine.reference_order) → timed run with link contention and memory
(engine.run) → SimResult.

Group-level simulation: a group's nodes run back to back on each replica, so a group's
priority is the highest of its nodes' priorities (it orders groups that compete for a device;
inside a group the graph order is kept, as the executor runs a group's submodule as a whole).

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

from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.simulate import engine
from heterog.simulate.blocks import make_blocks
from heterog.simulate.context import cluster_info, cost_table, grouping
from heterog.simulate.result import SimResult
from heterog.simulate.tasks import KIND_NAMES, OPT, SYNC, XFER, expand

_fingerprints: dict[int, tuple[object, str]] = {}
_validated: dict[int, Plan] = {}


def _fingerprint(obj) -> str:
    hit = _fingerprints.get(id(obj))
    if hit is None or hit[0] is not obj:
        if len(_fingerprints) > 16:
            _fingerprints.clear()
        hit = _fingerprints[id(obj)] = (obj, obj.fingerprint())
    return hit[1]


def check_plan(graph: OpGraph, cluster: Cluster, plan: Plan):
    """Validate `plan` against graph and cluster; cheap on repeated calls (cached pieces)."""
    if _validated.get(id(plan)) is not plan:    # plans are frozen: validate each object once
        plan.validate()
        if len(_validated) > 256:
            _validated.clear()
        _validated[id(plan)] = plan
    info = cluster_info(cluster)
    for g in plan.groups:
        for r in g.replicas:
            if r.device not in info.dev_id:
                raise PlanError(f"group {g.name!r} field 'replicas': device {r.device!r} is not in "
                                f"cluster {cluster.name!r}; use one of its devices "
                                f"({', '.join(info.devices[:6])}{' …' if len(info.devices) > 6 else ''}).")
        if g.ps_device is not None and g.ps_device not in info.dev_id:
            raise PlanError(f"group {g.name!r} field 'ps_device': device {g.ps_device!r} is not in "
                            f"cluster {cluster.name!r}.")
    if plan.cluster_fingerprint and plan.cluster_fingerprint != _fingerprint(cluster):
        raise PlanError(f"field 'cluster_fingerprint': the plan was made for another cluster "
                        f"({plan.cluster_fingerprint}, this one {_fingerprint(cluster)}); re-plan.")
    if plan.graph_fingerprint and plan.graph_fingerprint != _fingerprint(graph):
        raise PlanError(f"field 'graph_fingerprint': the plan was made for another model graph "
                        f"({plan.graph_fingerprint}, this one {_fingerprint(graph)}); re-plan.")
    return info, grouping(graph, [g.name for g in plan.groups], [g.nodes for g in plan.groups])


def simulate(graph: OpGraph, cluster: Cluster, plan: Plan, costs, *, timeline: bool = True) -> SimResult:
    """Simulate one iteration. `timeline=False` skips the memory timeline (the search's
    setting; events are built lazily either way)."""
    # The task graph is tens of thousands of small acyclic lists, freed by reference counting;
    # the cyclic collector would scan them (and the caches) over and over: ~30% of the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(graph, cluster, plan, costs, timeline)
    finally:
        if enabled:
            gc.enable()


def _simulate(graph: OpGraph, cluster: Cluster, plan: Plan, costs, timeline: bool) -> SimResult:
    info, grp = check_plan(graph, cluster, plan)
    table = cost_table(graph, costs)
    for g in plan.groups:
        if len(g.replicas) > 1 and g.sync == "none" and table.gradient_bytes(g.nodes) > 0:
            raise PlanError(f"group {g.name!r} field 'sync': replicated on {len(g.replicas)} devices "
                            f"with parameters but sync is 'none'; its replicas would diverge. "
                            f"Choose ring, tree, hierarchical or ps.")
    prio = plan.priorities
    if prio:
        group_prio = [max(prio.get(n, 0.0) for n in g.nodes) for g in plan.groups]
    else:
        group_prio = [0.0] * len(plan.groups)
    order = grp.order(group_prio)
    blocks = make_blocks(plan, order, grp, info, table)
    tasks = expand(plan, grp, blocks, info, table)
    n_dev = len(info.devices)
    ref = engine.reference_order(tasks, n_dev, plan.schedule)
    if ref is None:   # the 1F1B admission limit deadlocked (a device in non-adjacent stages)
        ref = engine.reference_order(tasks, n_dev, plan.schedule, limit_in_flight=False)
    assert ref is not None, "list scheduling without the admission rule cannot deadlock on a DAG"
    start, end, peak, overflow, mem_trace = engine.run(tasks, ref, n_dev, info.capacity_bytes, timeline,
                                                       info.shared_bw)
    return _result(plan, info, tasks, start, end, peak, overflow, mem_trace)


def _result(plan, info, tasks, start, end, peak, overflow, mem_trace) -> SimResult:
    used = sorted({d for b in tasks.blocks for d in b.devices}
                  | {b.ps_device for b in tasks.blocks if b.ps_device is not None})
    names = info.devices
    iteration = max(end) if end else 0.0
    compute = {d: 0.0 for d in used}
    comm = {d: 0.0 for d in used}
    link_busy: dict[int, float] = {}
    dur, dev = tasks.dur, tasks.dev
    by_members: dict[tuple[int, ...], float] = {}   # summed per member / link set first:
    by_links: dict[tuple[int, ...], float] = {}     # a collective has hundreds of each
    # per-device sums of compute time in task order (bincount adds in index order, like a loop)
    dev_a = np.array(dev)
    on_dev = dev_a >= 0
    per_dev = np.bincount(dev_a[on_dev], weights=np.array(dur)[on_dev], minlength=len(names)).tolist()
    for d in compute:
        compute[d] += per_dev[d]
    for t, (mk, _nbytes, _block) in tasks.comm.items():
        by_members[mk] = by_members.get(mk, 0.0) + dur[t]
        lk = tasks.links[t]
        by_links[lk] = by_links.get(lk, 0.0) + dur[t]
    for mk, x in by_members.items():
        for m in mk:
            comm[m] += x
    for lk, x in by_links.items():
        for l in lk:
            link_busy[l] = link_busy.get(l, 0.0) + x
    rep = tasks.rep
    for d in used:     # devices simulated through a representative share its timeline
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
        overflow_device=over_dev, overflow_bytes=over_bytes,
        compute_time_s={names[d]: compute[d] for d in used},
        communication_time_s={names[d]: comm[d] for d in used},
        idle_time_s={names[d]: max(iteration - compute[d], 0.0) for d in used},
        link_bytes={info.links[l]: b for l, b in sorted(tasks.link_bytes.items())},
        link_busy_time_s={info.links[l]: b for l, b in sorted(link_busy.items())},
        num_tasks=len(dur),
        memory_timeline={names[d]: tuple(mem_trace[d]) for d in used} if mem_trace else {},
        timeline_source=lambda: _events(tasks, info, start, end),
    )


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
                yield ("optimizer step", "optimizer", names[d], s, e)
            continue
        blk = blocks[tasks.block_of(t)]
        if k == XFER:
            a, b = tasks.comm[t][0]
            label = f"{blk.label} mb{tasks.mb[t]} {names[a]}→{names[b]}"
        elif k == SYNC:
            label = f"{blk.label} {blk.sync} sync"
        else:
            label = f"{blk.label} {'F' if k == 0 else 'B'} mb{tasks.mb[t]}"
        cat = KIND_NAMES[k]
        if tasks.dev[t] >= 0:
            for d in twins.get(tasks.dev[t], (tasks.dev[t],)):
                yield (label, cat, names[d], s, e)
            continue
        for m in tasks.comm[t][0]:
            yield (label, cat, names[m], s, e)
        for l in tasks.links[t]:
            yield (label, cat, f"link:{links[l]}", s, e)
