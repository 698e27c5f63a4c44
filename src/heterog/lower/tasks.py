"""Expansion of a Plan's blocks (blocks.py) into the tasks of one training iteration.

Tasks, per micro-batch m and block b with replica r on device d:
  F(b, m, r)  forward on d at the replica's integer samples (plan.replica_samples),
  B(b, m, r)  backward (plus a second forward when the group recomputes activations),
  X           re-partition transfers between blocks (transfers.py),
  S(b)        gradient sync of a replicated block after all its backwards of all micro-batches,
  O(d)        the optimizer step of device d after its syncs.
Columns are flat lists indexed by task id, memory effects and successors flat rows
(taskgraph.TaskRows), so the compiled loops touch no objects.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.ir.kinds import PipelineSchedule, ShardStage
from heterog.ir.plan import Plan, split_samples
from heterog.lower.blocks import Block, block_edges, stage_limits
from heterog.lower.caches import CostTable
from heterog.lower.columns import block_columns
from heterog.lower.context import ClusterInfo, id_runs
from heterog.lower.sync_tasks import sync_and_step
from heterog.lower.taskgraph import BWD, FWD, ComputeRun, CopyRun, Tasks, make_room
from heterog.lower.transfers import pair_moves, transfer_tasks


def _representatives(blocks, splits, p2p_sets, sizes, n_devices, dclass, merge: bool) -> list[int]:
    """rep[d]: the device whose tasks stand for d's. Devices that send or receive no
    point-to-point transfer, hold the same replicas of the same blocks at the same samples and
    are of the same class have identical timelines (they meet only in collectives, which
    wait for all members), so one of them is simulated for all — data parallelism over 1024
    devices of four types costs as much as over four."""
    p2p: set[int] = set()
    for ends in p2p_sets:
        p2p |= ends
    rep = list(range(n_devices))
    if not merge or len(p2p) >= n_devices - 1:
        return rep
    # blocks of one placement have the same members at the same samples: a device's
    # signature is its (placement, samples) list, built once per distinct placement
    sig: dict[int, list] = {}
    placements: dict[tuple, int] = {}
    for bi, blk in enumerate(blocks):
        pk = blk.placement
        if pk not in placements:
            pid = placements[pk] = len(placements)
            per_size = [splits[(size, blk.placement)] for size in sizes]
            for r, d in enumerate(blk.devices):
                if d not in p2p:
                    sig.setdefault(d, []).append((pid, tuple(sp[r] for sp in per_size)))
        if blk.shard_stage:  # a replica's piece of a sharded block sets its memory
            for r, d in enumerate(blk.devices):
                sig.setdefault(d, []).append(("shard", bi, blk.shard_stage, blk.shards[r]))
        if blk.ps_device is not None:
            sig.setdefault(blk.ps_device, []).append(("ps", bi))
    first: dict[tuple, int] = {}
    for d in sorted(sig):
        if d not in p2p:
            rep[d] = first.setdefault((dclass[d], tuple(sig[d])), d)
    return rep


def expand(
    plan: Plan, graph_grouping, blocks: list[Block], info: ClusterInfo, table: CostTable, *, merge: bool = True
) -> Tasks:
    """The task graph of one iteration. merge: simulate symmetric devices once and copy the
    tasks of equal-sized micro-batches (results are equal; the Program needs merge=False)."""
    tasks = Tasks(blocks, len(info.devices), plan.num_microbatches)
    preds = block_edges(graph_grouping, blocks, table)
    mb_sizes = split_samples(plan.batch_size, [1.0] * plan.num_microbatches)
    sizes = sorted(set(mb_sizes))
    splits: dict[tuple, list[int]] = {}
    known = table.caches.splits  # (size, placement) → samples per replica
    for size in sizes:
        for blk in blocks:
            key = (size, blk.placement)
            if key not in splits:
                hit = known.get(key)
                if hit is None:
                    if len(known) > 50_000:
                        known.clear()
                    hit = known[key] = split_samples(size, list(blk.shares))
                splits[key] = hit
    moves, p2p_sets = pair_moves(blocks, preds, sizes, splits, info, table)
    rep = tasks.rep = _representatives(blocks, splits, p2p_sets, sizes, len(info.devices), info.dev_class, merge)
    Bk, first_bwd = _microbatch_tasks(tasks, plan, preds, moves, splits, mb_sizes, info, table, merge)
    bwd_of_dev = _backwards_by_device(tasks, Bk)
    sync_and_step(tasks, plan, blocks, info, table, Bk, bwd_of_dev, rep, preds, splits, mb_sizes)
    _first_microbatch(tasks, first_bwd)
    if plan.schedule == PipelineSchedule.ONE_F_ONE_B:
        for d, limit in stage_limits([blk.devices for blk in blocks]).items():
            tasks.stage_limit[d] = limit
    tasks.seal()
    return tasks


def _microbatch_tasks(
    tasks: Tasks,
    plan: Plan,
    preds,
    moves,
    splits,
    mb_sizes: list[int],
    info: ClusterInfo,
    table: CostTable,
    merge: bool,
):
    """Forward, backward and transfer tasks of every micro-batch (equal-sized ones copied when
    merging). Returns (backward task ids per micro-batch and block, micro-batch 0's columns)."""
    Bk = Backwards(len(tasks.blocks), len(mb_sizes))
    templates: dict[int, Segment] = {}  # size → the first micro-batch of that size
    first_bwd: list[tuple] = []  # (first task, effect chunk indices, columns) of micro-batch 0's blocks
    comm = tasks.comm
    rep_key = table.caches.rep_id(tasks.rep)  # once per call: it hashes the merged-device map
    for m, size in enumerate(mb_sizes):
        if size in templates and merge:
            _replicate(tasks, templates[size], m, Bk)
            continue
        seg_start, comm_before = len(tasks.kind), len(comm)
        marks = (tasks.mem_start.mark(), tasks.mem_end.mark(), tasks.edges.mark())
        _compute_tasks(
            tasks, m, size, splits, info, table, rep_key, plan.schedule == PipelineSchedule.ONE_F_ONE_B, Bk, first_bwd
        )
        transfer_tasks(tasks, m, size, preds, moves, Bk, rep_key)
        templates[size] = Segment(
            m,
            seg_start,
            len(tasks.kind),
            list(comm)[comm_before:],
            marks,
            (tasks.mem_start.mark(), tasks.mem_end.mark(), tasks.edges.mark()),
            [],
        )
    return Bk, first_bwd


def _compute_tasks(
    tasks: Tasks,
    m: int,
    size: int,
    splits,
    info: ClusterInfo,
    table: CostTable,
    rep_key: int,
    one_f1b: bool,
    Bk: Backwards,
    first_bwd,
) -> None:
    """Micro-batch m's forwards and backwards: per block, its forwards then its backwards, one
    slice per column (the hot path); the columns that depend only on the block and the merged
    devices are cached."""
    rep = None  # the merged-device map as an array, made at the first miss
    column_cache = table.caches.columns
    replica_cache = table.caches.replica
    kinds = tasks.kind
    for bi, blk in enumerate(tasks.blocks):
        fresh = blk.shard_stage >= ShardStage.PARAMETERS  # every backward creates its gradients
        ck = (size, blk.nodes, blk.recompute, blk.placement, rep_key, fresh)
        cols = column_cache.get(ck)
        if cols is None:
            make_room(column_cache, len(blk.devices))
            if rep is None:
                rep = np.asarray(tasks.rep, dtype=np.int64)
            cols = column_cache[ck] = block_columns(
                blk, size, splits[(size, blk.placement)], rep, rep_key, info, replica_cache, table, fresh
            )
        kept_r = cols.kept
        n_kept = len(kept_r)
        f0 = len(kinds)
        b0 = f0 + n_kept
        kinds.extend([FWD] * n_kept)
        kinds.extend([BWD] * n_kept)
        tasks.dur.extend(cols.dur)
        tasks.dev.extend(cols.dev)
        tasks.links.extend([()] * (2 * n_kept))
        key_f, key_b = tasks.prio(1 if one_f1b else 0, m, bi), tasks.prio(0 if one_f1b else 1, m, -bi)
        tasks.key.extend([key_f] * n_kept)
        tasks.key.extend([key_b] * n_kept)
        tasks.mb.extend([m] * (2 * n_kept))
        if n_kept:
            tasks.runs.append(
                (f0, b0 + n_kept, ComputeRun(cols.dur_array, cols.dev_array, cols.kind_array, key_f, key_b, m))
            )
        if blk.pieces:
            _one_piece_at_a_time(tasks, f0, n_kept, cols.piece)
        chunks = (tasks.mem_start.add_chunk(f0, cols.at_start), tasks.mem_end.add_chunk(f0, cols.at_end))
        if m == 0:
            first_bwd.append((f0, chunks, cols))
        Bk.span[m][bi] = (b0, n_kept)
        Bk.cols[m][bi] = cols
    _forward_before_backward(tasks, Bk.span[m])


def _one_piece_at_a_time(tasks: Tasks, f0: int, n: int, piece: np.ndarray) -> None:
    """A replica that accumulates runs its pieces one after another: the forward of piece
    j + 1 waits for the backward of piece j (entries f0 + i forward, f0 + n + i backward). Over
    the identity edges between the blocks of its one placement, piece j + 1 starts only once
    piece j has run back through every block."""
    nxt = np.flatnonzero(piece[1:] > 0)  # entry i + 1 is the next piece of entry i's replica
    if len(nxt):
        tasks.edges.add_chunk(f0, (nxt + n, nxt + 1))


def _forward_before_backward(tasks: Tasks, spans: list[tuple[int, int]]) -> None:
    """Edges from each forward to its backward, for every block of a micro-batch at once (a
    forward's first edge: its transfers' come after)."""
    first = np.array([b0 for b0, _n in spans], dtype=np.int64)
    count = np.array([n for _b0, n in spans], dtype=np.int64)
    fwd = id_runs(first - count, count)
    tasks.edges.add_chunk(0, (fwd, fwd + np.repeat(count, count)))


def _backwards_by_device(tasks: Tasks, Bk: Backwards) -> dict[int, np.ndarray]:
    """Every device's backward tasks in id order (micro-batch, then block), the devices in the
    order of their first backward; and (tasks.bwd_count) how many each micro-batch has there:
    1F1B retires a micro-batch on a device when the last of them ends. From the blocks' spans
    of kept backwards and their devices, not from the task columns."""
    firsts, counts, devs, mbs = [], [], [], []
    for m, src in enumerate(Bk.copy_of):
        m0, off = (m, 0) if src is None else src
        n_m = 0
        for (b0, n), cols in zip(Bk.span[m0], Bk.cols[m0]):
            firsts.append(b0 + off)
            counts.append(n)
            devs.append(cols.kept_dev)
            n_m += n
        mbs.append(n_m)
    bwd = id_runs(firsts, counts)
    dev = np.concatenate(devs) if devs else np.zeros(0, dtype=np.int64)
    by_dev = np.argsort(dev, kind="stable")
    uniq, first, n_of = np.unique(dev[by_dev], return_index=True, return_counts=True)
    tasks_of = {d: bwd[by_dev[a : a + c]] for d, a, c in zip(uniq.tolist(), first.tolist(), n_of.tolist())}
    n_mb = len(mbs)
    pairs, n_pair = np.unique(dev * n_mb + np.repeat(np.arange(n_mb, dtype=np.int64), mbs), return_counts=True)
    tasks.bwd_count = {(p // n_mb, p % n_mb): c for p, c in zip(pairs.tolist(), n_pair.tolist())}
    return {d: tasks_of[d] for d in sorted(tasks_of, key=lambda d: tasks_of[d][0])}


def _first_microbatch(tasks: Tasks, first_bwd) -> None:
    """Micro-batch 0's backwards create the gradients (see columns.py): the later micro-batches
    were expanded or copied from it as adding into them, so its blocks' memory effects and
    backward durations are replaced by the first-micro-batch ones afterwards. Effects added by
    transfers stay after them."""
    for f0, (si, ei), cols in first_bwd:
        tasks.mem_start.replace_chunk(si, f0, cols.first_at_start)
        tasks.mem_end.replace_chunk(ei, f0, cols.first_at_end)
        n = len(cols.kept)
        if n:
            b0 = f0 + n
            tasks.dur[b0 : b0 + n] = cols.first_dur[n:]
            tasks.dur_patches.append((b0, cols.first_dur_array[n:]))


class Segment(NamedTuple):
    """The tasks of an expanded micro-batch that later ones of its size copy (_replicate)."""

    m0: int  # the micro-batch
    start: int  # its first task id
    end: int  # one past its last
    comm: list[int]  # its communication tasks
    since: tuple  # TaskRows marks (memory at start, at end, edges) before it
    until: tuple  # ... and after it
    copies: list  # keys and rows as arrays, made at the first copy


def _replicate(tasks: Tasks, template: Segment, m: int, Bk: Backwards) -> None:
    """Micro-batch m has the same size as an earlier one, so its tasks are a copy of that
    micro-batch's segment with ids shifted (and m in the priority keys): list slices and
    array chunks instead of a second expansion."""
    m0, start, end, seg_comm, since, until, rows = template
    off = len(tasks.kind) - start
    tasks.kind.extend(tasks.kind[start:end])
    tasks.dur.extend(tasks.dur[start:end])
    tasks.dev.extend(tasks.dev[start:end])
    tasks.links.extend(tasks.links[start:end])
    shift = (m - m0) * tasks.mb_stride
    rows_of = (tasks.mem_start, tasks.mem_end, tasks.edges)
    if not rows:  # the segment's keys and rows (one chunk each), made at the first copy
        keys = np.array(tasks.key[start:end], dtype=np.int64)
        rows.append((keys, keys >= 0))
        rows.extend(r.segment(a, b) for r, a, b in zip(rows_of, since, until))
    keys, compute = rows[0]
    tasks.key.extend((keys + shift * compute).tolist())  # communication keeps -1
    tasks.mb.extend([m] * (end - start))
    tasks.runs.append((off + start, off + end, CopyRun(start, shift, m)))
    for r, chunk in zip(rows_of, rows[1:]):
        r.add_chunk(off, chunk)
    comm, xfer_blocks = tasks.comm, tasks.xfer_blocks  # the segment's communication tasks
    comm.update([(t + off, comm[t]) for t in seg_comm])
    xfer_blocks.update([(t + off, xfer_blocks[t]) for t in seg_comm])
    Bk.copy_of[m] = (m0, off)


class Backwards:
    """Where each block's compute tasks are, per micro-batch: `span[m][b]` = (first backward
    id, count) of its kept replicas, whose forwards are the `count` ids before (both runs
    consecutive), and `cols[m][b]` its BlockColumns (devices, replica positions), for an
    expanded micro-batch; a replicated one is (m0, id offset) in `copy_of[m]` (see `runs`)."""

    __slots__ = ("span", "cols", "copy_of")

    def __init__(self, n_blocks: int, n_microbatches: int):
        self.span: list[list] = [[None] * n_blocks for _ in range(n_microbatches)]
        self.cols: list[list] = [[None] * n_blocks for _ in range(n_microbatches)]
        self.copy_of: list[tuple[int, int] | None] = [None] * n_microbatches

    def run_of(self, b: int, m: int) -> tuple[int, int]:
        """(first id, count) of the kept backwards of block b in micro-batch m."""
        src = self.copy_of[m]
        if src is None:
            return self.span[m][b]
        first, n = self.span[src[0]][b]
        return first + src[1], n

    def runs(self, blocks) -> list[tuple[int, int]]:
        """(first id, count) of the kept backwards of every micro-batch of `blocks`, by block,
        then micro-batch."""
        out = []
        for b in blocks:
            for m, src in enumerate(self.copy_of):
                if src is None:
                    out.append(self.span[m][b])
                else:
                    first, n = self.span[src[0]][b]
                    out.append((first + src[1], n))
        return out
