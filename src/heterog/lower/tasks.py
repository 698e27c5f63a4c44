"""Expansion of a Plan's blocks (blocks.py) into the tasks of one training iteration.

Tasks, per micro-batch m and block b with replica r on device d:
  F(b, m, r)  forward on d at the replica's integer samples (plan.replica_samples),
  B(b, m, r)  backward (plus a second forward when the group recomputes activations),
  X           re-partition transfers: replicas own contiguous sample ranges in order, so the
              samples replica i of a producer block shares with replica j of a consumer move
              i → j (activations forward, their gradients backward) over cluster.path,
  S(b)        gradient sync of a replicated block after all its backwards of all micro-batches,
  O(d)        the optimizer step of device d after its syncs.
Columns are flat lists indexed by task id, memory effects and successors flat rows
(taskgraph.TaskRows), so the compiled loops touch no objects.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.ir.plan import Plan, split_samples
from heterog.lower.blocks import Block, block_edges, moves_between, stage_limits
from heterog.lower.context import ClusterInfo, CostTable
from heterog.lower.sync_tasks import sync_and_step
from heterog.lower.taskgraph import BWD, FWD, SMALL_CHUNK, XFER, Tasks, make_room, rep_id


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
        pk = (blk.devices, blk.shares)
        if pk not in placements:
            pid = placements[pk] = len(placements)
            per_size = [splits[(size, blk.shares)] for size in sizes]
            for r, d in enumerate(blk.devices):
                if d not in p2p:
                    sig.setdefault(d, []).append((pid, tuple(sp[r] for sp in per_size)))
        if blk.ps_device is not None:
            sig.setdefault(blk.ps_device, []).append(("ps", bi))
    first: dict[tuple, int] = {}
    for d in sorted(sig):
        if d not in p2p:
            rep[d] = first.setdefault((dclass[d], tuple(sig[d])), d)
    return rep


def expand(plan: Plan, graph_grouping, blocks: list[Block], info: ClusterInfo,
           table: CostTable, *, merge: bool = True) -> Tasks:
    """The task graph of one iteration. merge: simulate symmetric devices once and copy the
    tasks of equal-sized micro-batches (results are equal; the Program needs merge=False)."""
    tasks = Tasks(blocks, len(info.devices), plan.num_microbatches)
    preds = block_edges(graph_grouping, blocks, table)
    mb_sizes = split_samples(plan.batch_size, [1.0] * plan.num_microbatches)
    sizes = sorted(set(mb_sizes))
    splits: dict[tuple, list[int]] = {}
    for size in sizes:
        for blk in blocks:
            if (size, blk.shares) not in splits:
                splits[(size, blk.shares)] = split_samples(size, list(blk.shares))
    moves, p2p_sets = _moves(blocks, preds, sizes, splits, info, table)
    rep = tasks.rep = _representatives(blocks, splits, p2p_sets, sizes, len(info.devices), info.dev_class, merge)
    Bk, first_bwd = _microbatch_tasks(tasks, plan, preds, moves, splits, mb_sizes, info, table, merge)
    bwd_of_dev = _backwards_by_device(tasks)
    sync_and_step(tasks, plan, blocks, info, table, Bk, bwd_of_dev, rep, preds, splits, mb_sizes)
    _first_microbatch_memory(tasks, first_bwd)
    if plan.schedule == "1f1b":
        for d, limit in stage_limits([blk.devices for blk in blocks]).items():
            tasks.stage_limit[d] = limit
    tasks.seal()
    return tasks


def _moves(blocks: list[Block], preds, sizes: list[int], splits, info: ClusterInfo, table: CostTable):
    """The re-partition moves between every pair of connected blocks, per micro-batch size
    ((size, producer, consumer) → moves, or None for an identity), and the device sets that
    send or receive point to point."""
    moves: dict[tuple[int, int, int], list | None] = {}
    move_cache = table.scratch.setdefault("moves", {})
    p2p_sets: list[frozenset[int]] = []
    for size in sizes:
        for bi, blk in enumerate(blocks):
            for a, (fx, ps) in preds[bi].items():
                src = blocks[a]
                ck = (size, src.devices, src.shares, blk.devices, blk.shares, fx, ps)
                hit = move_cache.get(ck)
                if hit is None:
                    if len(move_cache) > 20_000:
                        move_cache.clear()
                    mv = moves_between(src, blk, splits[(size, src.shares)], splits[(size, blk.shares)],
                                       size, fx, ps, info, table)
                    ends = frozenset(d for x in mv if x[5] is not None for d in x[:2])
                    # identity: replica i feeds replica i on the same device, nothing crosses a
                    # link (consecutive blocks of one placement); expanded without the tuples
                    ident = (src.devices == blk.devices and len(mv) == len(blk.devices)
                             and all(x[2] == x[3] == i and x[5] is None for i, x in enumerate(mv)))
                    hit = move_cache[ck] = (None if ident else mv, ends)
                moves[(size, a, bi)] = hit[0]
                if hit[1]:
                    p2p_sets.append(hit[1])
    return moves, p2p_sets


def _microbatch_tasks(tasks: Tasks, plan: Plan, preds, moves, splits, mb_sizes: list[int],
                      info: ClusterInfo, table: CostTable, merge: bool):
    """Forward, backward and transfer tasks of every micro-batch (equal-sized ones copied when
    merging). Returns (backward task ids per micro-batch and block, micro-batch 0's columns)."""
    nb, mbs = len(tasks.blocks), len(mb_sizes)
    F = [[None] * nb for _ in range(mbs)]
    Bk = [[None] * nb for _ in range(mbs)]
    templates: dict[int, tuple] = {}   # size → first mb's segment (see _replicate)
    first_bwd: list[tuple] = []   # (first task, effect chunk indices, columns) of micro-batch 0's blocks
    lb, comm = tasks.link_bytes, tasks.comm
    rep_key = rep_id(table.scratch, tasks.rep)     # once per call: it hashes the merged-device map
    for m, size in enumerate(mb_sizes):
        if size in templates and merge:
            _replicate(tasks, templates[size], m, F, Bk)
            continue
        seg_start, lb_before, comm_before = len(tasks.kind), dict(lb), len(comm)
        marks = (tasks.mem_start.mark(), tasks.mem_end.mark(), tasks.edges.mark())
        _compute_tasks(tasks, m, size, splits, info, table, rep_key, plan.schedule == "1f1b", F, Bk, first_bwd)
        _transfer_tasks(tasks, m, size, preds, moves, F, Bk)
        templates[size] = (m, seg_start, len(tasks.kind), {l: v - lb_before.get(l, 0.0) for l, v in lb.items()},
                           list(comm)[comm_before:], marks,
                           (tasks.mem_start.mark(), tasks.mem_end.mark(), tasks.edges.mark()))
    return Bk, first_bwd


def _compute_tasks(tasks: Tasks, m: int, size: int, splits, info: ClusterInfo, table: CostTable,
                   rep_key: int, one_f1b: bool, F, Bk, first_bwd) -> None:
    """Micro-batch m's forwards and backwards: per block, its forwards then its backwards, one
    slice per column (the hot path); the columns that depend only on the block and the merged
    devices are cached."""
    rep = tasks.rep
    column_cache = table.scratch.setdefault("columns", {})
    replica_cache = table.scratch.setdefault("replica", {})
    kinds = tasks.kind
    for bi, blk in enumerate(tasks.blocks):
        ck = (size, blk.nodes, blk.recompute, blk.devices, blk.shares, rep_key)
        cols = column_cache.get(ck)
        if cols is None:
            make_room(column_cache, len(blk.devices))
            cols = column_cache[ck] = _block_columns(blk, splits[(size, blk.shares)], rep, info.dev_class,
                                                     replica_cache, table)
        kept_r = cols.kept
        n_kept = len(kept_r)
        f0 = len(kinds)
        b0 = f0 + n_kept
        kinds.extend([FWD] * n_kept)
        kinds.extend([BWD] * n_kept)
        tasks.dur.extend(cols.dur)
        tasks.dev.extend(cols.dev)
        tasks.links.extend([()] * (2 * n_kept))
        tasks.edges.add_chunk(f0, cols.fwd_to_bwd)
        tasks.key.extend([tasks.prio(1 if one_f1b else 0, m, bi)] * n_kept)
        tasks.key.extend([tasks.prio(0 if one_f1b else 1, m, -bi)] * n_kept)
        tasks.mb.extend([m] * (2 * n_kept))
        chunks = (tasks.mem_start.add_chunk(f0, cols.at_start), tasks.mem_end.add_chunk(f0, cols.at_end))
        if m == 0:
            first_bwd.append((f0, chunks, cols))
        if n_kept == len(blk.devices):
            F[m][bi], Bk[m][bi] = list(range(f0, b0)), list(range(b0, b0 + n_kept))
        else:
            fids, bids = [None] * len(blk.devices), [None] * len(blk.devices)
            for k, r in enumerate(kept_r):
                fids[r], bids[r] = f0 + k, b0 + k
            F[m][bi], Bk[m][bi] = fids, bids


def _transfer_tasks(tasks: Tasks, m: int, size: int, preds, moves, F, Bk) -> None:
    """Micro-batch m's re-partition transfers between blocks (activations forward, their
    gradients backward), or plain dependencies where nothing crosses a link."""
    rep, comm, lb, xfer_blocks = tasks.rep, tasks.comm, tasks.link_bytes, tasks.xfer_blocks
    mem, dep = tasks.mem, tasks.dep
    for bi in range(len(tasks.blocks)):
        Fb, Bb = F[m][bi], Bk[m][bi]
        for a in preds[bi]:
            Fa, Ba = F[m][a], Bk[m][a]
            mv = moves[(size, a, bi)]
            if mv is None:    # identity re-partition: replica i feeds replica i (see _identity)
                _identity(tasks, Fa, Fb, Ba, Bb)
                continue
            for da, db, i, j, nbytes, path, back, t_f, t_b in mv:
                if rep[da] != da or rep[db] != db:
                    continue   # a merged device: its representative carries the dependency
                fa, fb, ba, bb = Fa[i], Fb[j], Ba[i], Bb[j]
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
                # the receiver holds the tensor until the task that reads it ends
                mem(xf, True, db, nbytes)
                mem(xb, True, da, nbytes)
                comm[xf] = ((da, db), nbytes, bi)
                comm[xb] = ((db, da), nbytes, a)
                xfer_blocks[xf] = xfer_blocks[xb] = (a, bi)
                dep(fa, xf)
                dep(bb, xb)
                mem(fb, False, db, -nbytes)
                mem(ba, False, da, -nbytes)
                for l in path:
                    lb[l] = lb.get(l, 0.0) + nbytes
                for l in back:
                    lb[l] = lb.get(l, 0.0) + nbytes


def _identity(tasks: Tasks, Fa: list, Fb: list, Ba: list, Bb: list) -> None:
    """Edges of an identity re-partition as one chunk: forward i of the producer before forward
    i of the consumer, backward i of the consumer before backward i of the producer. Both
    blocks have the same devices and merged devices, so their kept replicas' tasks are runs of
    consecutive ids (a merged device has None)."""
    fa0 = next((x for x in Fa if x is not None), None)
    if fa0 is None:
        return
    fb0 = next(x for x in Fb if x is not None)
    ba0 = next(x for x in Ba if x is not None)
    bb0 = next(x for x in Bb if x is not None)
    n = ba0 - fa0       # kept replicas: a block's backwards follow its forwards
    if n <= SMALL_CHUNK:
        for i in range(n):
            tasks.dep(fa0 + i, fb0 + i)
            tasks.dep(bb0 + i, ba0 + i)
        return
    k = np.arange(n, dtype=np.int64)
    tasks.edges.add_chunk(0, (np.concatenate((k + fa0, k + bb0)), np.concatenate((k + fb0, k + ba0))))


def _backwards_by_device(tasks: Tasks) -> dict[int, np.ndarray]:
    """Every device's backward tasks in id order (micro-batch, then block), the devices in the
    order of their first backward; and (tasks.bwd_count) how many each micro-batch has there:
    1F1B retires a micro-batch on a device when the last of them ends."""
    kind = np.array(tasks.kind, dtype=np.int64)
    bwd = np.flatnonzero(kind == BWD)
    dev = np.array(tasks.dev, dtype=np.int64)[bwd]
    by_dev = np.argsort(dev, kind="stable")
    devs, first, counts = np.unique(dev[by_dev], return_index=True, return_counts=True)
    tasks_of = {d: bwd[by_dev[a:a + c]] for d, a, c in zip(devs.tolist(), first.tolist(), counts.tolist())}
    n_mb = max(tasks.mb, default=0) + 1
    pairs, count = np.unique(dev * n_mb + np.array(tasks.mb, dtype=np.int64)[bwd], return_counts=True)
    tasks.bwd_count = {(p // n_mb, p % n_mb): c for p, c in zip(pairs.tolist(), count.tolist())}
    return {d: tasks_of[d] for d in sorted(tasks_of, key=lambda d: tasks_of[d][0])}


def _first_microbatch_memory(tasks: Tasks, first_bwd) -> None:
    """Micro-batch 0's backward also creates the gradients (see _block_columns): its blocks'
    effect chunks are replaced by the first-micro-batch ones after the other micro-batches
    were copied from it. Effects added by transfers stay after them."""
    for f0, (si, ei), cols in first_bwd:
        tasks.mem_start.replace_chunk(si, f0, cols.first_at_start)
        tasks.mem_end.replace_chunk(ei, f0, cols.first_at_end)


class BlockColumns(NamedTuple):
    """What expand adds for one block in one micro-batch, cached: it depends only on the
    block, its samples and the merged devices. Task i is the forward of kept replica i, task
    n + i its backward (n kept replicas); chunks hold task ids relative to the first."""
    kept: list[int]                 # replicas simulated (the others are merged devices)
    dev: list[int]                  # device of each task
    dur: list[float]                # duration of each task
    at_start: tuple                 # memory effects at task starts (TaskRows chunk)
    at_end: tuple                   # ... at task ends
    first_at_start: tuple           # the same for micro-batch 0, whose backwards create
    first_at_end: tuple             # the gradients
    fwd_to_bwd: tuple               # edges: each forward before its backward


def _block_columns(blk: Block, samples: list[int], rep: list[int], dclass: list[str],
                   replica_cache: dict, table: CostTable) -> BlockColumns:
    """The block's columns (BlockColumns) from its replicas' costs (_replica_costs)."""
    kept = [(r, d, dclass[d], samples[r]) for r, d in enumerate(blk.devices) if rep[d] == d]
    vs = []
    for _r, _d, dn, smp in kept:
        ck = (blk.nodes, blk.recompute, dn, smp)
        v = replica_cache.get(ck)
        if v is None:
            if len(replica_cache) > 200_000:
                replica_cache.clear()
            v = replica_cache[ck] = _replica_costs(blk, dn, smp, table)
        vs.append(v)
    devs = [d for _r, d, _dn, _s in kept]
    n = len(kept)
    d = np.array(devs, dtype=np.int64)
    v = np.array(vs, dtype=np.float64).reshape(n, 7)
    act, ws, peak_later, peak_first, grad = v[:, 2], v[:, 3], v[:, 4], v[:, 5], v[:, 6]   # see _replica_costs
    # forward: its activations and workspace; backward: up to its peak, then down to nothing;
    # micro-batch 0's backward peaks at peak_first and leaves the gradients behind
    fwd_start = _chunk(d, act + ws, (act != 0) | (ws != 0), 0)
    fwd_end = _chunk(d, -ws, ws != 0, 0)
    return BlockColumns(
        kept=[r for r, _d, _dn, _s in kept], dev=devs + devs, dur=[x[0] for x in vs] + [x[1] for x in vs],
        at_start=_joined(fwd_start, _chunk(d, peak_later - act, peak_later != act, n)),
        at_end=_joined(fwd_end, _chunk(d, -peak_later, peak_later != 0, n)),
        first_at_start=_joined(fwd_start, _chunk(d, peak_first - act, None, n)),
        first_at_end=_joined(fwd_end, _chunk(d, grad - peak_first, None, n)),
        fwd_to_bwd=(np.arange(n, dtype=np.int64), np.arange(n, 2 * n, dtype=np.int64)))


def _chunk(devs: np.ndarray, delta: np.ndarray, where: np.ndarray | None, first: int) -> tuple[np.ndarray, ...]:
    """Effects of replicas (task first + i for replica i) where `where` holds (all if None)."""
    i = np.arange(len(devs), dtype=np.int64) if where is None else np.flatnonzero(where)
    return i + first, devs[i], delta[i]


def _joined(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.concatenate(pair) for pair in zip(a, b))


def _replica_costs(blk: Block, dn: str, samples: int, table: CostTable) -> tuple[float, ...]:
    """Costs of one replica of a block on a device of class dn at `samples`:
    (forward s, backward s, activations saved by the forward, largest forward workspace,
     backward peak above the level before it — later micro-batches, backward peak — the first
     micro-batch, whose gradients appear meanwhile, gradient bytes).

    The backward is walked group by group in reverse (PyTorch frees a group's saved
    activations after its backward; with zero_grad(set_to_none=True) its gradients appear
    then): while group k runs, the activations of groups ≤ k (group k's in full when it
    recomputes), the gradients of groups ≥ k and k's workspace are alive.
    """
    fwd = bwd = 0.0
    acts, fulls, grads, wss = [], [], [], []
    for nodes in blk.nodes:
        f_s, b_s = table.times_s(nodes, dn, samples)
        fwd += f_s
        bwd += b_s + (f_s if blk.recompute else 0.0)   # recompute runs the forward again
        act = table.activation_bytes(nodes, samples, blk.recompute)
        acts.append(act)
        # recompute: in its backward a group holds its kept activations plus the largest
        # block it rebuilds (never more than its full activations)
        fulls.append(min(act + table.recompute_transient_bytes(nodes, samples),
                         table.activation_bytes(nodes, samples, False)) if blk.recompute else act)
        grads.append(table.gradient_bytes(nodes))
        wss.append(table.workspace_bytes(nodes, samples))
    act_all, grad_all = sum(acts), sum(grads)
    below = act_all          # activations of groups before k
    after = 0.0              # gradients of groups ≥ k
    peak_later = peak_first = 0.0
    for k in range(len(acts) - 1, -1, -1):
        below -= acts[k]
        after += grads[k]
        alive = below + fulls[k] + wss[k]
        peak_later = max(peak_later, alive)
        peak_first = max(peak_first, alive + after)
    return (fwd, bwd, act_all, max(wss, default=0.0), peak_later, peak_first, grad_all)


def _replicate(tasks: Tasks, template, m: int, F, Bk) -> None:
    """Micro-batch m has the same size as an earlier one, so its tasks are a copy of that
    micro-batch's segment with ids shifted (and m in the priority keys): list slices instead of
    a second expansion."""
    m0, start, end, seg_link_bytes, seg_comm, since, until = template
    off = len(tasks.kind) - start
    tasks.kind.extend(tasks.kind[start:end])
    tasks.dur.extend(tasks.dur[start:end])
    tasks.dev.extend(tasks.dev[start:end])
    tasks.links.extend(tasks.links[start:end])
    shift = (m - m0) * tasks.mb_stride
    tasks.key.extend([k + shift if k >= 0 else k for k in tasks.key[start:end]])
    tasks.mb.extend([m] * (end - start))
    tasks.mem_start.copy(since[0], until[0], off)
    tasks.mem_end.copy(since[1], until[1], off)
    tasks.edges.copy(since[2], until[2], off)
    comm = tasks.comm
    for t in seg_comm:      # the segment's communication tasks
        comm[t + off] = comm[t]
        tasks.xfer_blocks[t + off] = tasks.xfer_blocks[t]
    for l, v in seg_link_bytes.items():
        tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + v
    for bi in range(len(F[m0])):
        F[m][bi] = [x + off if x is not None else None for x in F[m0][bi]]
        Bk[m][bi] = [x + off if x is not None else None for x in Bk[m0][bi]]


