"""Plan + OpGraph + Cluster + costs → the iteration's schedule: blocks, tasks and their order.

One function per rule, applied in this order (each lives in one place):
  check_plan        the plan against graph and cluster (devices, fingerprints, sync)
  Grouping.order    groups in a topological order that follows the plan's priorities
  make_blocks       same-placement runs fused into blocks, cut into gradient buckets
  expand            per micro-batch and replica: forward, backward, re-partition transfers
                    (sample ranges), gradient sync per bucket, optimizer step; memory effects
  reference_order   the global execution order (GPipe / 1F1B with its in-flight window)
  compute_gathers   stage-3 sharded blocks: a parameter gather before each compute, placed
                    by the first order, then the order again (shard_tasks.py)
The simulator times this schedule (simulate/engine.py); `lowering.to_program` writes it out per
device as the Program the executor carries out. The two therefore cannot disagree.

Group-level scheduling: a group's nodes run back to back on each replica, so a group's
priority is the highest of its nodes' priorities (it orders groups that compete for a device;
inside a group the graph order is kept, as the executor runs a group's submodule as a whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.lower.blocks import Block, make_blocks
from heterog.lower.context import ClusterInfo, Grouping, SimCache
from heterog.lower.order import reference_order
from heterog.lower.shard_tasks import compute_gathers
from heterog.lower.sync_tasks import tied_bytes
from heterog.lower.taskgraph import Tasks
from heterog.lower.tasks import expand
from heterog.lower.tensor_parallel import refuse_tensor_parallel


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One iteration's tasks and the order every device runs them in."""

    plan: Plan
    info: ClusterInfo
    grouping: Grouping
    blocks: list[Block]
    tasks: Tasks
    order: np.ndarray  # task ids in the global reference order
    merged: bool  # symmetric devices simulated once (tasks.rep), micro-batches copied


def check_plan(graph: OpGraph, cluster: Cluster, plan: Plan, cache: SimCache, costs=None):
    """Validate `plan` against graph and cluster; cheap on repeated calls (cached pieces).
    A cost model may name devices whose costs are their own (`own_class_devices`)."""
    refuse_tensor_parallel(plan, "the schedule of whole tasks per device")
    cache.validate(plan)
    info = cache.cluster_info(cluster, getattr(costs, "own_class_devices", frozenset()))
    for g in plan.groups:
        if cache.placement(g.replicas)[3] in info.known_device_sets:
            continue  # this device set was checked against this cluster before
        for r in g.replicas:
            if r.device not in info.dev_id:
                raise PlanError(
                    f"group {g.name!r} field 'replicas': device {r.device!r} is not in "
                    f"cluster {cluster.name!r}; use one of its devices "
                    f"({', '.join(info.devices[:6])}{' …' if len(info.devices) > 6 else ''})."
                )
        info.known_device_sets.add(cache.placement(g.replicas)[3])
    for g in plan.groups:
        if g.ps_device is not None and g.ps_device not in info.dev_id:
            raise PlanError(
                f"group {g.name!r} field 'ps_device': device {g.ps_device!r} is not in cluster {cluster.name!r}."
            )
    fp = cache.fingerprint(cluster)
    if plan.cluster_fingerprint and plan.cluster_fingerprint != fp:
        raise PlanError(
            f"field 'cluster_fingerprint': the plan was made for another cluster "
            f"({plan.cluster_fingerprint}, this one {fp}); re-plan."
        )
    fp = cache.fingerprint(graph)
    if plan.graph_fingerprint and plan.graph_fingerprint != fp:
        raise PlanError(
            f"field 'graph_fingerprint': the plan was made for another model graph "
            f"({plan.graph_fingerprint}, this one {fp}); re-plan."
        )
    return info, cache.grouping(graph, [g.name for g in plan.groups], [g.nodes for g in plan.groups])


def cover_graph(plan: Plan, graph: OpGraph) -> Plan:
    """The plan with every graph node it does not name put in a group, by the partitioner's rule
    for loose ops (cut/partition.py): a node follows its first predecessor's group, else its
    first successor's, else the first group. Plans written by hand often name only the model's
    module calls; the capture also records loose ops and the loss."""
    owner: dict[str, int | None] = {n: gi for gi, g in enumerate(plan.groups) for n in g.nodes}
    missing = [n.name for n in graph.nodes if n.name not in owner]
    if not missing:
        return plan
    pred, succ = graph.predecessors, graph.successors
    for n in missing:  # graph nodes are in topological order: producers first
        owner[n] = next((owner[p] for p in pred[n] if p in owner), None)
    for n in reversed(missing):
        if owner[n] is None:
            owner[n] = next((owner[s] for s in succ[n] if owner.get(s) is not None), 0)
    added: dict[int, list[str]] = {}
    for n in missing:
        added.setdefault(owner[n] or 0, []).append(n)
    groups = tuple(
        dataclasses.replace(g, nodes=tuple(g.nodes) + tuple(added.get(gi, ()))) for gi, g in enumerate(plan.groups)
    )
    return dataclasses.replace(plan, groups=groups)


def _order(tasks, n_dev: int, schedule: str) -> np.ndarray | None:
    """The reference order; None only if the task graph has a cycle."""
    order = reference_order(tasks, n_dev, schedule)
    if order is None:  # the 1F1B admission limit deadlocked (a device in non-adjacent stages)
        order = reference_order(tasks, n_dev, schedule, limit_in_flight=False)
    return order


def build_schedule(
    graph: OpGraph, cluster: Cluster, plan: Plan, costs, *, cache: SimCache | None = None, merge: bool = True
) -> Schedule:
    """The schedule of one iteration. merge=True lets symmetric devices share one timeline and
    equal micro-batches share tasks (the simulator's shortcut; results are equal); the Program
    needs every device's own instructions (merge=False)."""
    cache = cache if cache is not None else SimCache()
    info, grp = check_plan(graph, cluster, plan, cache, costs)
    table = cache.cost_table(graph, costs)
    for g in plan.groups:
        if len(g.replicas) > 1 and g.sync == SyncMethod.NONE and table.gradient_bytes(g.nodes) > 0:
            raise PlanError(
                f"group {g.name!r} field 'sync': replicated on {len(g.replicas)} devices "
                f"with parameters but sync is 'none'; its replicas would diverge. "
                f"Choose ring, tree, hierarchical or ps."
            )
    prio = plan.priorities
    group_prio = [max(prio.get(n, 0.0) for n in g.nodes) for g in plan.groups] if prio else [0.0] * len(plan.groups)
    blocks = make_blocks(plan, grp.order(group_prio), grp, info, table, cache)
    n_dev = len(info.devices)
    tasks = expand(plan, grp, blocks, info, table, merge=merge)
    order = _order(tasks, n_dev, plan.schedule)
    assert order is not None, "list scheduling without the admission rule cannot deadlock on a DAG"
    if compute_gathers(tasks, order, blocks, info, table, tied_bytes(blocks, table)):
        gathered = _order(tasks, n_dev, plan.schedule)  # the gathers' waits may move work
        if gathered is None:  # members wait for each other's gathers in a cycle: the safe rule
            tasks = expand(plan, grp, blocks, info, table, merge=merge)
            compute_gathers(tasks, order, blocks, info, table, tied_bytes(blocks, table), forward_only=True)
            gathered = _order(tasks, n_dev, plan.schedule)
        assert gathered is not None, "gathers placed forward in the first order cannot make a cycle"
        order = gathered
    return Schedule(plan=plan, info=info, grouping=grp, blocks=blocks, tasks=tasks, order=order, merged=merge)
