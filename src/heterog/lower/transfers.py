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

from heterog.lower.blocks import Block, Moves, moves_between
from heterog.lower.caches import CostTable
from heterog.lower.context import ClusterInfo
from heterog.lower.taskgraph import XFER, Tasks, TransferRun

SMALL_PAIR = 4  # moves up to which a pair's transfers are added row by row


class PairMoves(NamedTuple):
    """The moves between two placements at one micro-batch size (None: an identity, replica i
    feeds replica i on the same device), the devices that send or receive point to point, and
    the pair's templates per merged-device map (LoweringCaches.rep_id)."""

    moves: Moves | None
    ends: frozenset
    templates: dict


def pair_moves(blocks: list[Block], preds, sizes: list[int], splits, info: ClusterInfo, table: CostTable):
    """The re-partition moves between every pair of connected blocks, per micro-batch size
    ((size, producer, consumer) → PairMoves), and the device sets that send or receive point
    to point."""
    moves: dict[tuple[int, int, int], PairMoves] = {}
    move_cache = table.caches.moves
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
                    mv = moves_between(
                        src,
                        blk,
                        splits[(size, src.placement)],
                        splits[(size, blk.placement)],
                        size,
                        fx,
                        ps,
                        info,
                        table,
                    )
                    ends = frozenset(np.concatenate((mv.src[mv.cross], mv.dst[mv.cross])).tolist())
                    # identity: consecutive blocks of one placement; expanded without the moves
                    ident = (
                        src.devices == blk.devices
                        and mv.count == len(blk.devices)
                        and not ends
                        and bool((mv.i == np.arange(mv.count)).all() and (mv.j == mv.i).all())
                    ) or (bool(src.pieces) and src.placement == blk.placement and not ends)  # piece j feeds piece j
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
            elif pm.moves.count <= SMALL_PAIR:
                _one_by_one(tasks, m, a, bi, pm.moves, spans[a], spans[bi], cols[a].position, cols[bi].position)
            else:
                tpl = pm.templates.get(rep_key)
                if tpl is None:
                    if len(pm.templates) > 8:
                        pm.templates.clear()
                    tpl = pm.templates[rep_key] = _template(
                        pm.moves, tasks.rep, cols[a].position, cols[bi].position, spans[a][1], spans[bi][1], a, bi
                    )
                _add_pair(tasks, m, a, bi, tpl, spans[a][0] - spans[a][1], spans[bi][0] - spans[bi][1])


def _rows(mv: Moves):
    """The moves one by one: (src, dst, i, j, bytes, path, back path, t_fwd, t_bwd)."""
    return zip(
        mv.src.tolist(),
        mv.dst.tolist(),
        mv.i.tolist(),
        mv.j.tolist(),
        mv.nbytes.tolist(),
        mv.paths,
        mv.backs,
        mv.t_fwd.tolist(),
        mv.t_bwd.tolist(),
    )


def _one_by_one(tasks: Tasks, m: int, a: int, bi: int, mv: Moves, span_a, span_b, pos_a, pos_b) -> None:
    """A pair's moves row by row (see the module docstring): replica i's forward is the
    producer's first forward + its kept position, its backward the first backward + that."""
    rep, comm, xfer_blocks = tasks.rep, tasks.comm, tasks.xfer_blocks
    mem, dep = tasks.mem, tasks.dep
    ba0, bb0 = span_a[0], span_b[0]
    fa0, fb0 = ba0 - span_a[1], bb0 - span_b[1]
    for da, db, i, j, nbytes, path, back, t_f, t_b in _rows(mv):
        if rep[da] != da or rep[db] != db:
            continue  # a merged device: its representative carries the dependency
        pi, pj = pos_a[i], pos_b[j]
        fa, fb, ba, bb = fa0 + pi, fb0 + pj, ba0 + pi, bb0 + pj
        if path is None:  # same device, or nothing to send
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
    cuts: tuple[int, int, int]  # where the four id columns meet in rel
    start_dev: np.ndarray  # effects at start: device, bytes
    start_bytes: np.ndarray
    end_dev: np.ndarray  # effects at end
    end_bytes: np.ndarray
    kind: list[int]  # columns of the transfer tasks, two per move
    dur: list[float]
    dur_array: np.ndarray
    none: list[int]  # -1 per task (device, priority key)
    links: list[tuple]
    comm: list[tuple]


def _template(
    mv: Moves, rep: list[int], pos_a: list, pos_b: list, n_a: int, n_b: int, a: int, bi: int
) -> PairTransfers:
    """A pair's transfers as arrays, rows in the order _one_by_one adds them (pos: replica →
    kept position; n: kept replicas). Per move, in _one_by_one's order: edges (xf→fb, xb→ba,
    fa→xf, bb→xb) where something crosses, (fa→fb, bb→ba) where not; then two effects at
    start and six at end per crossing move."""
    rep_a = np.asarray(rep, dtype=np.int64)
    k = np.flatnonzero((rep_a[mv.src] == mv.src) & (rep_a[mv.dst] == mv.dst))
    c = mv.cross[k]
    da, db, nb = mv.src[k], mv.dst[k], mv.nbytes[k]
    fa = np.asarray(pos_a, dtype=np.int64)[mv.i[k]]
    fb = np.asarray(pos_b, dtype=np.int64)[mv.j[k]]
    ba, bb = fa + n_a, fb + n_b
    xf = 2 * (np.cumsum(c) - 1)
    xb = xf + 1
    zero, one, two = np.zeros_like(fa), np.ones_like(fa), np.full_like(fa, 2)
    keep = np.column_stack((np.ones_like(c), np.ones_like(c), c, c)).ravel()

    def column(*cols):  # per move four edges (rows), flattened, the unused dropped
        return np.column_stack(cols).ravel()[keep]

    src_rel = column(np.where(c, xf, fa), np.where(c, xb, bb), fa, bb)
    src_sel = column(np.where(c, two, zero), np.where(c, two, one), zero, one)
    dst_rel = column(fb, ba, xf, xb)
    dst_sel = column(one, zero, two, two)
    start_rel = np.column_stack((xf, xb))[c].ravel()
    ends = np.column_stack((fb, ba, fa, xb, bb, xb))[c].ravel()
    end_sel = np.tile(np.array((1, 0, 0, 2, 1, 2), dtype=np.int64), int(c.sum()))
    da_c, db_c, nb_c = da[c], db[c], nb[c]
    kc = k[c].tolist()
    dur = np.column_stack((mv.t_fwd[k][c], mv.t_bwd[k][c])).ravel()
    links = [p for x in kc for p in (mv.paths[x], mv.backs[x])]
    comm = [
        t for s, d, n in zip(da_c.tolist(), db_c.tolist(), nb_c.tolist()) for t in (((s, d), n, bi), ((d, s), n, a))
    ]
    n_e, n_s = len(src_rel), len(start_rel)
    return PairTransfers(
        rel=np.concatenate((src_rel, dst_rel, start_rel, ends)),
        sel=np.concatenate((src_sel, dst_sel, np.full(n_s, 2, dtype=np.int64), end_sel)),
        cuts=(n_e, 2 * n_e, 2 * n_e + n_s),
        start_dev=np.column_stack((db_c, da_c)).ravel(),
        start_bytes=np.column_stack((nb_c, nb_c)).ravel(),
        end_dev=np.column_stack((db_c, da_c, da_c, da_c, db_c, db_c)).ravel(),
        end_bytes=np.column_stack((-nb_c, -nb_c, nb_c, -nb_c, nb_c, -nb_c)).ravel(),
        kind=[XFER] * len(dur),
        dur=dur.tolist(),
        dur_array=dur,
        none=[-1] * len(dur),
        links=links,
        comm=comm,
    )


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
    if n <= 2:  # cached chunks cost less than rows from 3 replicas on
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
