"""A warm start: an earlier plan as a strategy of a new problem — the same model on a cluster
that lost or gained devices (an elastic run's re-plan, runs/elastic.py).

The new problem groups the graph afresh (grouping depends on the cluster), so each new group
takes the placement of the old group that holds most of its nodes; replicas on devices the new
cluster lacks are dropped and the shares of the rest scaled up to one. A group left with no
device goes to the fastest surviving device of the old plan. A parameter server on a lost
device becomes a ring. Devices the new cluster adds are not used by the start: the chain's
moves add them (and the baselines, which use every device, start beside it).
"""

from __future__ import annotations

from collections import Counter

from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import Group, Plan
from heterog.search.problem import Placement, Problem, Strategy


def warm_start(prob: Problem, plan: Plan) -> Strategy | None:
    """`plan` restricted to `prob`'s devices, on `prob`'s groups; None when none of the
    plan's devices is left (then the usual starts are all there is)."""
    index = {d: i for i, d in enumerate(prob.device_names)}
    kept = {index[d] for d in plan.devices() if d in index}
    if not kept:
        return None
    fallback = min(kept, key=prob.speed_order.index)
    owner = {n: g for g in plan.groups for n in g.nodes}
    placements = []
    for names in prob.groups:
        votes = Counter(owner[n].name for n in names if n in owner)
        old = next((g for g in plan.groups if g.name == votes.most_common(1)[0][0]), None) if votes else None
        placements.append(_restricted(old, index, fallback))
    m = plan.num_microbatches if prob.batch_size % plan.num_microbatches == 0 else 1
    return Strategy(tuple(placements), m, plan.schedule, plan.bucket_bytes)


def _restricted(old: Group | None, index: dict[str, int], fallback: int) -> Placement:
    """The old group's placement on the devices that are left (see the module docstring)."""
    pairs = sorted((index[r.device], r.share) for r in (old.replicas if old else ()) if r.device in index)
    if not pairs or sum(s for _, s in pairs) <= 0:
        return Placement((fallback,), (1.0,), recompute=bool(old and old.recompute))
    total = sum(s for _, s in pairs)
    devices = tuple(d for d, _ in pairs)
    shares = tuple(s / total for _, s in pairs)
    assert old is not None  # pairs came from its replicas
    sync, ps = SyncMethod(old.sync), None
    if len(devices) == 1:
        sync = SyncMethod.NONE
    elif sync is SyncMethod.PS:
        ps = index.get(old.ps_device or "")
        sync = SyncMethod.PS if ps is not None else SyncMethod.RING
    elif sync is SyncMethod.NONE:
        sync = SyncMethod.RING
    return Placement(devices, shares, sync, ps, old.recompute)
