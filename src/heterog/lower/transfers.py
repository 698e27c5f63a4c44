"""Re-partition transfers between blocks, as tasks of one micro-batch.

Replicas own contiguous sample ranges of a micro-batch in replica order, so the samples
replica i of a producer block shares with replica j of a consumer move i → j (blocks.py
`moves_between`): activations forward, their gradients backward, each a transfer task over
cluster.path, or a plain dependency where nothing crosses a link. Memory, as the executor holds
it: the receiver holds a tensor from its transfer's start until the task that reads it ends;
the sender holds an activation from the task that makes it until the gradient of the same
move has come back (gloo calls a send complete only once waited for, and the executor waits
for it then), and a gradient it sends until that transfer ends. A pair of blocks with many
moves adds them as array chunks from a per-pair template (PairTransfers, cached: the search
re-scores the same pairs constantly); a pair with a few adds them row by row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.lower.blocks import Block, moves_between
from heterog.lower.context import ClusterInfo, CostTable
from heterog.lower.taskgraph import XFER, Tasks, TransferRun

SMALL_PAIR = 4    # moves up to which a pair's transfers are added row by row


class PairMoves(NamedTuple):
    """The moves between two placements at one micro-batch size (None: an identity, replica i
    feeds replica i on the same device), the devices that send or receive point to point, and
    the pair's templates per merged-device map (rep_id)."""
    moves: list | None
    ends: frozenset
    templates: dict


def pair_moves(blocks: list[Block], preds, sizes: list[int], splits, info: ClusterInfo, table: CostTable):
    """The re-partition moves between every pair of connected blocks, per micro-batch size
    ((size, producer, consumer) → PairMoves), and the device sets that send or receive point
    to point."""
    moves: dict[tuple[int, int, int], PairMoves] = {}
    move_cache = table.scratch.setdefault("moves", {})
    p2p_sets: list[frozenset[int]] = []
    for size in sizes:
        for bi, blk in enumerate(blocks):
            for a, (fx, ps) in preds[bi].items():
                src = blocks[a]
                ck = (size, src.placement, blk.placement, fx, ps)
                hit = move_cache.get(ck)
                if hit is None:
                    if len(move_cache) > 20_000:
                        move_cache.clear()
                    mv = moves_between(src, blk, splits[(size, src.placement)], splits[(size, blk.placement)],
                                       size, fx, ps, info, table)
                    ends = frozenset(d for x in mv if x[5] is not None for d in x[:2])
                    # identity: consecutive blocks of one placement; expanded without the tuples
                    ident = (src.devices == blk.devices and len(mv) == len(blk.devices)
                             and all(x[2] == x[3] == i and x[5] is None for i, x in enumerate(mv)))
                    hit = move_cache[ck] = PairMoves(None if ident else mv, ends, {})
                moves[(size, a, bi)] = hit
                if hit.ends:
                    p2p_sets.append(hit.ends)
    return moves, p2p_sets


def transfer_tasks(tasks: Tasks, m: int, size: int, preds, moves, Bk, rep_key: int) -> None:
    """Micro-batch m's re-partition transfers between blocks (activations forward, their
    gradients backward), or plain dependencies where nothing crosses a link. Bk: where the
    blocks' compute tasks are (tasks.Backwards)."""
    spans, cols = Bk.span[m], Bk.cols[m]
    for bi in range(len(tasks.blocks)):
        for a in preds[bi]:
            pm = moves[(size, a, bi)]
            if pm.moves is None:
                _identity(tasks, spans[a], spans[bi], pm.templates)
            elif len(pm.moves) <= SMALL_PAIR:
                _one_by_one(tasks, m, a, bi, pm.moves, spans[a], spans[bi], cols[a].position, cols[bi].position)
            else:
                tpl = pm.templates.get(rep_key)
                if tpl is None:
                    if len(pm.templates) > 8:
                        pm.templates.clear()
                    tpl = pm.templates[rep_key] = _template(pm.moves, tasks.rep, cols[a].position, cols[bi].position,
                                                            spans[a][1], spans[bi][1], a, bi)
                _add_pair(tasks, m, a, bi, tpl, spans[a][0] - spans[a][1], spans[bi][0] - spans[bi][1])


def _one_by_one(tasks: Tasks, m: int, a: int, bi: int, mv: list, span_a, span_b, pos_a, pos_b) -> None:
    """A pair's moves row by row (see the module docstring): replica i's forward is the
    producer's first forward + its kept position, its backward the first backward + that."""
    rep, comm, xfer_blocks = tasks.rep, tasks.comm, tasks.xfer_blocks
    mem, dep = tasks.mem, tasks.dep
    ba0, bb0 = span_a[0], span_b[0]
    fa0, fb0 = ba0 - span_a[1], bb0 - span_b[1]
    for da, db, i, j, nbytes, path, back, t_f, t_b in mv:
        if rep[da] != da or rep[db] != db:
            continue   # a merged device: its representative carries the dependency
        pi, pj = pos_a[i], pos_b[j]
        fa, fb, ba, bb = fa0 + pi, fb0 + pj, ba0 + pi, bb0 + pj
        if path is None:          # same device, or nothing to send
            dep(fa, fb)
            dep(bb, ba)
            continue
        xf = len(tasks.kind)
        xb = xf + 1
        tasks.kind.extend((XFER, XFER))
        tasks.dur.extend((t_f, t_b))
        tasks.dev.extend((-1, -1))
        tasks.links.extend((path, back))
        dep(xf, fb)
        dep(xb, ba)
        tasks.key.extend((-1, -1))
        tasks.mb.extend((m, m))
        # the receiver holds the tensor until the task that reads it ends; the sender holds
        # an activation until its gradient is back, a gradient until it has left
        mem(xf, True, db, nbytes)
        mem(xb, True, da, nbytes)
        comm[xf] = ((da, db), nbytes, bi)
        comm[xb] = ((db, da), nbytes, a)
        xfer_blocks[xf] = xfer_blocks[xb] = (a, bi)
        dep(fa, xf)
        dep(bb, xb)
        mem(fb, False, db, -nbytes)
        mem(ba, False, da, -nbytes)
        mem(fa, False, da, nbytes)
        mem(xb, False, da, -nbytes)
        mem(bb, False, db, nbytes)
        mem(xb, False, db, -nbytes)


class PairTransfers(NamedTuple):
    """What _one_by_one would add for a pair, as arrays. Task ids are relative to one of three
    bases (sel 0: the producer's first forward, 1: the consumer's, 2: the pair's first
    transfer); `rel`/`sel` hold, in turn, the edges' sources, their targets, the tasks of
    the effects at start and of those at end."""
    rel: np.ndarray
    sel: np.ndarray
    cuts: tuple[int, int, int]      # where the four id columns meet in rel
    start_dev: np.ndarray           # effects at start: device, bytes
    start_bytes: np.ndarray
    end_dev: np.ndarray             # effects at end
    end_bytes: np.ndarray
    kind: list[int]                 # columns of the transfer tasks, two per move
    dur: list[float]
    dur_array: np.ndarray
    none: list[int]                 # -1 per task (device, priority key)
    links: list[tuple]
    comm: list[tuple]


def _template(mv: list, rep: list[int], pos_a: list, pos_b: list, n_a: int, n_b: int, a: int, bi: int) -> PairTransfers:
    """A pair's transfers as arrays, rows in the order _one_by_one adds them (pos: replica →
    kept position; n: kept replicas)."""
    edges: list[tuple] = []
    starts, ends = [], []
    dur, links, comm = [], [], []
    for da, db, i, j, nbytes, path, back, t_f, t_b in mv:
        if rep[da] != da or rep[db] != db:
            continue
        fa, ba, fb, bb = (0, pos_a[i]), (0, n_a + pos_a[i]), (1, pos_b[j]), (1, n_b + pos_b[j])
        if path is None:
            edges += [(fa, fb), (bb, ba)]
            continue
        xf, xb = (2, len(dur)), (2, len(dur) + 1)
        edges += [(xf, fb), (xb, ba), (fa, xf), (bb, xb)]
        starts += [(xf, db, nbytes), (xb, da, nbytes)]
        ends += [(fb, db, -nbytes), (ba, da, -nbytes), (fa, da, nbytes), (xb, da, -nbytes),
                 (bb, db, nbytes), (xb, db, -nbytes)]
        dur += [t_f, t_b]
        links += [path, back]
        comm += [((da, db), nbytes, bi), ((db, da), nbytes, a)]
    ids = [e[0] for e in edges] + [e[1] for e in edges] + [s[0] for s in starts] + [e[0] for e in ends]
    n_e, n_s = len(edges), len(starts)
    return PairTransfers(
        rel=np.array([x[1] for x in ids], dtype=np.int64), sel=np.array([x[0] for x in ids], dtype=np.int64),
        cuts=(n_e, 2 * n_e, 2 * n_e + n_s),
        start_dev=np.array([s[1] for s in starts], dtype=np.int64),
        start_bytes=np.array([s[2] for s in starts], dtype=np.float64),
        end_dev=np.array([e[1] for e in ends], dtype=np.int64),
        end_bytes=np.array([e[2] for e in ends], dtype=np.float64),
        kind=[XFER] * len(dur), dur=dur, dur_array=np.array(dur, dtype=np.float64), none=[-1] * len(dur),
        links=links, comm=comm)


def _add_pair(tasks: Tasks, m: int, a: int, bi: int, tpl: PairTransfers, fa0: int, fb0: int) -> None:
    """A pair's transfers from its template, as chunks at the current position."""
    x0 = len(tasks.kind)
    n = len(tpl.dur)
    ids = tpl.rel + np.array((fa0, fb0, x0), dtype=np.int64)[tpl.sel]
    c1, c2, c3 = tpl.cuts
    tasks.kind.extend(tpl.kind)
    tasks.dur.extend(tpl.dur)
    tasks.dev.extend(tpl.none)
    tasks.links.extend(tpl.links)
    tasks.key.extend(tpl.none)
    tasks.mb.extend([m] * n)
    tasks.edges.add_chunk(0, (ids[:c1], ids[c1:c2]))
    if n:
        tasks.runs.append((x0, x0 + n, TransferRun(tpl.dur_array, m)))
        tasks.mem_start.add_chunk(0, (ids[c2:c3], tpl.start_dev, tpl.start_bytes))
        tasks.mem_end.add_chunk(0, (ids[c3:], tpl.end_dev, tpl.end_bytes))
        new = range(x0, x0 + n)
        tasks.comm.update(zip(new, tpl.comm))
        tasks.xfer_blocks.update(dict.fromkeys(new, (a, bi)))


def _identity(tasks: Tasks, span_a: tuple[int, int], span_b: tuple[int, int], chunks: dict) -> None:
    """Edges of an identity re-partition: forward i of the producer before forward i of the
    consumer, backward i of the consumer before backward i of the producer. Both blocks have
    the same devices and merged devices, so their kept replicas' tasks are runs of
    consecutive ids (spans: first backward, count); a run is one chunk, cached by the runs'
    relative positions (in `chunks`, the pair's templates)."""
    ba0, n = span_a
    bb0 = span_b[0]
    fa0, fb0 = ba0 - n, bb0 - n
    if n <= 2:     # cached chunks cost less than rows from 3 replicas on
        for i in range(n):
            tasks.dep(fa0 + i, fb0 + i)
            tasks.dep(bb0 + i, ba0 + i)
        return
    key = (n, fb0 - fa0, bb0 - fa0)
    chunk = chunks.get(key)
    if chunk is None:
        if len(chunks) > 64:
            chunks.clear()
        k = np.arange(n, dtype=np.int64)
        chunk = chunks[key] = (np.concatenate((k, k + (bb0 - fa0))), np.concatenate((k + (fb0 - fa0), k + n)))
    tasks.edges.add_chunk(fa0, chunk)
