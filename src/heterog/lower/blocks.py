"""Blocks: the units the simulator schedules, and the re-partition between them.

Groups run in a priority-respecting topological order (context.Grouping.order). Consecutive
groups in that order with the same placement (devices, shares, sync, recompute, sharding) that exchange
data with other placements only at the run's ends run back to back on every replica with no
communication between them, so they are fused into one *block*. A replicated block is also
one gradient bucket: a run is cut, walking backward, wherever its gradients would exceed
plan.bucket_bytes, so synchronisation of the later layers overlaps the backward of the
earlier ones (PyTorch DDP's bucketing, Li et al., VLDB 2020).

Between blocks, replicas own contiguous sample ranges of each micro-batch in replica order,
so the samples replica i of a producer shares with replica j of a consumer move i → j.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import Plan
from heterog.lower.caches import CostTable
from heterog.lower.context import ClusterInfo, SimCache


@dataclass(slots=True)
class Block:
    groups: tuple[int, ...]  # group indices, in execution order
    nodes: tuple[tuple[str, ...], ...]  # their node tuples (cost-cache keys)
    devices: tuple[int, ...]  # replica device ids
    shares: tuple[float, ...]
    placement: int  # number of (devices, shares) in the SimCache: a cache key
    device_set: int  # number of the devices alone
    sync: str
    ps_device: int | None
    recompute: bool
    label: str
    shard_stage: int = 0  # ZeRO stage (ir/kinds.py ShardStage); 0: every replica holds all state
    shards: tuple[float, ...] = ()  # each replica's fraction of the sharded state (sharded blocks)
    pieces: tuple[int, ...] = ()  # each replica's accumulation count (ir/accumulation.py); () when all 1


def make_blocks(
    plan: Plan, order: list[int], grouping, info: ClusterInfo, table: CostTable, cache: SimCache
) -> list[Block]:
    """Fuse runs of groups (see the module docstring). A group joins the run before it only if
    it has the same placement, none of its inputs come from another placement, and the run's
    last group sends nothing to another placement: a fused run then receives only at its start
    and sends only at its end, so fusion delays no other device."""
    groups = plan.groups
    places = [cache.placement(g.replicas) for g in groups]
    keys = [(pl[0], g.sync, g.ps_device, g.recompute, g.shard_stage, g.shards) for pl, g in zip(places, groups)]
    runs: list[list[int]] = []
    for g in order:
        key = keys[g]
        if (
            runs
            and keys[runs[-1][-1]] == key
            and all(keys[p] == key for p in grouping.pred[g])
            and all(keys[s] == key for s in grouping.succ[runs[-1][-1]])
        ):
            runs[-1].append(g)
        else:
            runs.append([g])
    blocks: list[Block] = []
    dev_id = info.dev_id
    for run in runs:
        grp = groups[run[0]]
        replicated = len(grp.replicas) > 1 and grp.sync != SyncMethod.NONE
        pieces = (
            gradient_buckets(run, [table.gradient_bytes(groups[g].nodes) for g in run], plan.bucket_bytes)
            if replicated
            else [run]
        )
        for p in pieces:
            names = [groups[g].name for g in p]
            blocks.append(
                Block(
                    groups=tuple(p),
                    nodes=tuple(groups[g].nodes for g in p),
                    devices=info.ids(places[run[0]][1]),
                    shares=places[run[0]][2],
                    placement=places[run[0]][0],
                    device_set=places[run[0]][3],
                    sync=grp.sync,
                    ps_device=dev_id[grp.ps_device] if grp.ps_device else None,
                    recompute=grp.recompute,
                    label=names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}",
                    shard_stage=int(grp.shard_stage),
                    shards=grp.shards,
                    pieces=tuple(r.accumulate for r in grp.replicas) if accumulates(grp) else (),
                )
            )
    return blocks


def accumulates(group) -> bool:
    """True when some replica of the group runs its share in several pieces."""
    return any(r.accumulate != 1 for r in group.replicas)


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


Amount = TypeVar("Amount", int, float)  # samples (the executor) or shares (the estimate)


def overlaps(a: Sequence[Amount], b: Sequence[Amount]) -> Iterator[tuple[int, int, Amount]]:
    """(i, j, n): n samples owned by replica i of one split and replica j of the other,
    when both own contiguous ranges of the same micro-batch in replica order. For a few
    replicas (the search's estimate, the executor's ranges); `overlap_arrays` is the same
    rule over arrays, for blocks of hundreds of replicas (tests hold the two equal)."""
    i = j = 0
    ea, eb = a[0] if a else 0, b[0] if b else 0
    pos: Amount = a[0] - a[0] if a else 0  # zero of the amounts' type
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


def overlap_arrays(a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`overlaps` as three arrays (i, j, n): each overlap ends where one of the two replicas
    owning it ends; the owners are the first replicas whose ranges reach that end (an empty
    replica never owns one)."""
    ea, eb = np.cumsum(a), np.cumsum(b)
    if not len(ea) or not len(eb):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=ea.dtype if len(ea) else eb.dtype)
    cuts = np.union1d(ea, eb)
    cuts = cuts[(cuts > 0) & (cuts <= min(ea[-1], eb[-1]))]
    return (
        np.searchsorted(ea, cuts, "left"),
        np.searchsorted(eb, cuts, "left"),
        np.diff(cuts, prepend=cuts.dtype.type(0)),
    )


@dataclass(frozen=True, slots=True)
class Moves:
    """The re-partition between two placements, one entry per (producer replica, consumer
    replica) pair that shares samples, in sample order: devices, replicas, bytes, whether
    anything crosses a link (a different device and bytes to send), the paths there and back
    (None where nothing crosses) and the uncontended times (0 where nothing crosses)."""

    src: np.ndarray
    dst: np.ndarray
    i: np.ndarray
    j: np.ndarray
    nbytes: np.ndarray
    cross: np.ndarray
    paths: list
    backs: list
    t_fwd: np.ndarray
    t_bwd: np.ndarray

    @property
    def count(self) -> int:
        return len(self.src)


def _pair_rows(info: ClusterInfo, table: CostTable, keys: list[int]) -> list[tuple]:
    """Per device pair (key: src · devices + dst): the paths there and back and the transfer
    time lines (fixed s, s per byte) both ways, kept in the cost table for its cluster's
    numbering."""
    n = len(info.devices)
    known = table.caches.p2p_pairs.setdefault(id(info), {})
    rows = []
    for key in keys:
        r = known.get(key)
        if r is None:
            a, b = divmod(key, n)
            sa, sb = info.devices[a], info.devices[b]
            r = known[key] = (
                info.path(a, b),
                info.path(b, a),
                *table.transfer_line(sa, sb),
                *table.transfer_line(sb, sa),
            )
        rows.append(r)
    return rows


def moves_between(
    src: Block,
    dst: Block,
    asplit: list[int],
    bsplit: list[int],
    size: int,
    fx: float,
    ps: float,
    info: ClusterInfo,
    table: CostTable,
) -> Moves:
    """The re-partition between two placements, with its paths and uncontended times. The
    search re-scores the same pairs constantly, so the caller caches these per cost table."""
    i, j, n = overlap_arrays(asplit, bsplit)
    da = np.asarray(src.devices, dtype=np.int64)[i]
    db = np.asarray(dst.devices, dtype=np.int64)[j]
    nbytes = fx * n / size + ps * n
    cross = (da != db) & (nbytes > 0)
    paths: list = [None] * len(da)
    backs: list = [None] * len(da)
    t_fwd, t_bwd = np.zeros(len(da)), np.zeros(len(da))
    k = np.flatnonzero(cross)
    if len(k):
        rows = _pair_rows(info, table, (da[k] * len(info.devices) + db[k]).tolist())
        for idx, r in zip(k.tolist(), rows):
            paths[idx], backs[idx] = r[0], r[1]
        fixed_f, per_f, fixed_b, per_b = np.array([r[2:] for r in rows]).T
        t_fwd[k] = fixed_f + per_f * nbytes[k]
        t_bwd[k] = fixed_b + per_b * nbytes[k]
    return Moves(
        src=da, dst=db, i=i, j=j, nbytes=nbytes, cross=cross, paths=paths, backs=backs, t_fwd=t_fwd, t_bwd=t_bwd
    )


def block_edges(grouping, blocks: list[Block], table: CostTable) -> list[dict[int, tuple[float, float]]]:
    """preds[b][a] = (fixed, per-sample) bytes from block a to block b. A producer node's
    tensor is sent once per consumer block even when several of its nodes read it. Cached
    per grouping and cut of its groups into blocks (read only: shared between calls)."""
    cache = table.caches.block_edges
    key = (id(grouping), tuple(b.groups for b in blocks))
    hit = cache.get(key)
    if hit is None or hit[0] is not grouping:
        if len(cache) > 10_000:
            cache.clear()
        hit = cache[key] = (grouping, _block_edges(grouping, blocks, table))
    return hit[1]


def _block_edges(grouping, blocks: list[Block], table: CostTable) -> list[dict[int, tuple[float, float]]]:
    block_of_group = {}
    for bi, blk in enumerate(blocks):
        for g in blk.groups:
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
