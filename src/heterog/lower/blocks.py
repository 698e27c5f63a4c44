"""Blocks: the units the simulator schedules, and the re-partition between them.

Groups run in a priority-respecting topological order (context.Grouping.order). Consecutive
groups in that order with the same placement (devices, shares, sync, recompute) that exchange
data with other placements only at the run's ends run back to back on every replica with no
communication between them, so they are fused into one *block*. A replicated block is also
one gradient bucket: a run is cut, walking backward, wherever its gradients would exceed
plan.bucket_bytes, so synchronisation of the later layers overlaps the backward of the
earlier ones (PyTorch DDP's bucketing, Li et al., VLDB 2020).

Between blocks, replicas own contiguous sample ranges of each micro-batch in replica order,
so the samples replica i of a producer shares with replica j of a consumer move i → j.
"""

from __future__ import annotations

from dataclasses import dataclass

from heterog.ir.plan import Plan
from heterog.lower.context import ClusterInfo, CostTable, SimCache


@dataclass(slots=True)
class Block:
    groups: tuple[int, ...]          # group indices, in execution order
    nodes: tuple[tuple[str, ...], ...]  # their node tuples (cost-cache keys)
    devices: tuple[int, ...]         # replica device ids
    shares: tuple[float, ...]
    placement: int                   # number of (devices, shares) in the SimCache: a cache key
    device_set: int                  # number of the devices alone
    sync: str
    ps_device: int | None
    recompute: bool
    label: str


def make_blocks(plan: Plan, order: list[int], grouping, info: ClusterInfo, table: CostTable,
                cache: SimCache) -> list[Block]:
    """Fuse runs of groups (see the module docstring). A group joins the run before it only if
    it has the same placement, none of its inputs come from another placement, and the run's
    last group sends nothing to another placement: a fused run then receives only at its start
    and sends only at its end, so fusion delays no other device."""
    groups = plan.groups
    places = [cache.placement(g.replicas) for g in groups]
    keys = [(pl[0], g.sync, g.ps_device, g.recompute) for pl, g in zip(places, groups)]
    runs: list[list[int]] = []
    for g in order:
        key = keys[g]
        if (runs and keys[runs[-1][-1]] == key
                and all(keys[p] == key for p in grouping.pred[g])
                and all(keys[s] == key for s in grouping.succ[runs[-1][-1]])):
            runs[-1].append(g)
        else:
            runs.append([g])
    blocks: list[Block] = []
    dev_id = info.dev_id
    for run in runs:
        grp = groups[run[0]]
        replicated = len(grp.replicas) > 1 and grp.sync != "none"
        pieces = (gradient_buckets(run, [table.gradient_bytes(groups[g].nodes) for g in run], plan.bucket_bytes)
                  if replicated else [run])
        for p in pieces:
            names = [groups[g].name for g in p]
            blocks.append(Block(
                groups=tuple(p), nodes=tuple(groups[g].nodes for g in p),
                devices=info.ids(places[run[0]][1]), shares=places[run[0]][2], placement=places[run[0]][0],
                device_set=places[run[0]][3],
                sync=grp.sync,
                ps_device=dev_id[grp.ps_device] if grp.ps_device else None,
                recompute=grp.recompute,
                label=names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"))
    return blocks


def gradient_buckets(run: list[int], grad_bytes: list[float], limit: float) -> list[list[int]]:
    """Cut a run of identically placed groups into gradient buckets of at most `limit` bytes,
    filled in backward order as DDP fills its buckets (Li et al., VLDB 2020): the last groups'
    gradients, ready first, are synchronised while the earlier groups' backward runs."""
    pieces: list[list[int]] = []
    acc = 0.0
    for g, gb in zip(reversed(run), reversed(grad_bytes)):
        if pieces and acc > 0 and acc + gb > limit:
            pieces.append([])
            acc = 0.0
        if not pieces:
            pieces.append([])
        pieces[-1].append(g)
        acc += gb
    return [list(reversed(p)) for p in reversed(pieces)]


def stage_limits(device_sets: list[tuple[int, ...]]) -> dict[int, int]:
    """1F1B: a device whose first stage is s (of p) keeps at most p − s micro-batches in flight
    (Narayanan et al., PipeDream-Flush, SC'21). A stage is a maximal run of consecutive blocks
    (or groups) on the same device set; `device_sets` lists them in execution order."""
    stages = 0
    first: dict[int, int] = {}
    last = None
    for ds in device_sets:
        key = frozenset(ds)
        if key != last:
            stages += 1
            last = key
        for d in ds:
            first.setdefault(d, stages - 1)
    return {d: stages - s for d, s in first.items()}


def sent_once(edges, size) -> list:
    """A producer's tensor crosses to a consumer block once, however many of the block's nodes
    read it: of each producer's (producer, value) edges keep the one of largest size(value)."""
    best: dict = {}
    for src, value in edges:
        old = best.get(src)
        if old is None or size(value) > size(old):
            best[src] = value
    return list(best.values())


def overlaps(a: list[int], b: list[int]):
    """(i, j, n): n samples owned by replica i of one split and replica j of the other,
    when both own contiguous ranges of the same micro-batch in replica order."""
    i = j = 0
    ea, eb = a[0] if a else 0, b[0] if b else 0
    pos = 0
    while i < len(a) and j < len(b):
        end = min(ea, eb)
        if end > pos:
            yield i, j, end - pos
            pos = end
        if ea <= eb:
            i += 1
            if i < len(a):
                ea += a[i]
        else:
            j += 1
            if j < len(b):
                eb += b[j]


def moves_between(src: Block, dst: Block, asplit: list[int], bsplit: list[int], size: int, fx: float, ps: float,
           info: ClusterInfo, table: CostTable) -> list[tuple]:
    """The re-partition between two placements, with its paths and uncontended times:
    (src device, dst device, src replica, dst replica, bytes, path, back path, t_fwd, t_bwd);
    path is None when nothing crosses a link. The search re-scores the same pairs constantly,
    so the caller caches these per cost table."""
    out = []
    names = info.devices
    for i, j, n in overlaps(asplit, bsplit):
        da, db = src.devices[i], dst.devices[j]
        nbytes = fx * n / size + ps * n
        if da == db or nbytes <= 0:
            out.append((da, db, i, j, nbytes, None, None, 0.0, 0.0))
        else:
            out.append((da, db, i, j, nbytes, info.path(da, db), info.path(db, da),
                        table.transfer_s(nbytes, names[da], names[db]),
                        table.transfer_s(nbytes, names[db], names[da])))
    return out


def block_edges(grouping, blocks: list[Block], table: CostTable) -> list[dict[int, tuple[float, float]]]:
    """preds[b][a] = (fixed, per-sample) bytes from block a to block b. A producer node's
    tensor is sent once per consumer block even when several of its nodes read it. Cached
    per grouping and cut of its groups into blocks (read only: shared between calls)."""
    cache = table.scratch.setdefault("block edges", {})
    key = (id(grouping), tuple(b.groups for b in blocks))
    hit = cache.get(key)
    if hit is None or hit[0] is not grouping:
        if len(cache) > 10_000:
            cache.clear()
        hit = cache[key] = (grouping, _block_edges(grouping, blocks, table))
    return hit[1]


def _block_edges(grouping, blocks: list[Block], table: CostTable) -> list[dict[int, tuple[float, float]]]:
    block_of_group = {}
    for bi, b in enumerate(blocks):
        for g in b.groups:
            block_of_group[g] = bi
    preds: list[dict[int, tuple[float, float]]] = [dict() for _ in blocks]
    for (ga, gb), edges in grouping.cross.items():
        a, b = block_of_group[ga], block_of_group[gb]
        if a == b:
            continue
        moved = sent_once(((src, table.edge_bytes(src, dst)) for src, dst in edges), lambda v: v[0] + v[1])
        fx0, ps0 = preds[b].get(a, (0.0, 0.0))
        preds[b][a] = (fx0 + sum(v[0] for v in moved), ps0 + sum(v[1] for v in moved))
    return preds
