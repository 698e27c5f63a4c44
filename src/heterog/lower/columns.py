"""A block's compute tasks in one micro-batch as cached columns (BlockColumns): durations,
devices and memory effects of its kept replicas' forwards and backwards, from the cost model's
answers per distinct (device class, samples).

A replica that accumulates (ir/accumulation.py) has one *entry* per piece, its pieces' entries
consecutive: each entry a forward and a backward at the piece's samples, and only piece 0's
backward creates the gradients (in micro-batch 0, or in every micro-batch of a `fresh` block);
the later pieces add into them, as a later micro-batch does."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.lower.blocks import Block
from heterog.lower.caches import CostTable
from heterog.lower.context import ClusterInfo
from heterog.lower.taskgraph import BWD, FWD, make_room


class BlockColumns(NamedTuple):
    """What expand adds for one block in one micro-batch, cached: it depends only on the
    block, its samples and the merged devices. Task i is the forward of entry i (a kept
    replica, or a piece of one that accumulates), task n + i its backward (n entries); chunks
    hold task ids relative to the first."""

    kept: list[int]  # each entry's replica: those simulated (the others are merged devices)
    kept_dev: np.ndarray  # their devices
    piece: np.ndarray  # each entry's piece of its replica's samples (KeptReplicas)
    position: list  # replica → the index of its first entry (-1 if merged)
    dev: list[int]  # device of each task
    dur: list[float]  # duration of each task (backwards adding into held gradients)
    dev_array: np.ndarray  # the same as arrays (Tasks.array), and the tasks' kinds
    dur_array: np.ndarray
    kind_array: np.ndarray
    first_dur: list[float]  # the same for micro-batch 0, whose backwards create the
    first_dur_array: np.ndarray  # gradients instead of adding into them
    at_start: tuple  # memory effects at task starts (TaskRows chunk)
    at_end: tuple  # ... at task ends
    first_at_start: tuple  # the same for micro-batch 0, whose backwards create
    first_at_end: tuple  # the gradients


class KeptReplicas(NamedTuple):
    """What a block's columns share with every block of its placement at one micro-batch size
    and merged-device map (cached: data parallelism has one placement for all blocks). One
    entry per kept replica, or per piece of one that accumulates."""

    kept: list[int]  # each entry's replica (the others are merged devices)
    devices: np.ndarray  # their devices
    piece: np.ndarray  # each entry's piece of its replica's samples (0 unless it accumulates)
    position: list  # replica → the index of its first entry (-1 if merged)
    costs_of: list[tuple[str, int]]  # distinct (device class, samples) of the kept
    which: np.ndarray  # kept replica → its index in costs_of
    dev: list[int]  # the tasks' devices (forwards, then backwards)
    dev_array: np.ndarray
    kind_array: np.ndarray


def _kept_replicas(blk: Block, samples: list[int], rep: np.ndarray, info: ClusterInfo) -> KeptReplicas:
    devs_all = info.device_array(blk.devices)
    kept_r = np.flatnonzero(rep[devs_all] == devs_all)
    smp = np.asarray(samples, dtype=np.int64)[kept_r]
    piece = np.zeros(len(kept_r), dtype=np.int64)
    if blk.pieces:
        kept_r, smp, piece = _pieces(kept_r, smp, np.asarray(blk.pieces, dtype=np.int64)[kept_r])
    d = devs_all[kept_r]
    n = len(d)
    base = int(smp.max()) + 1 if n else 1
    distinct, which = _distinct(info.class_index[d] * base + smp)
    position = np.full(len(devs_all), -1, dtype=np.int64)
    position[kept_r[piece == 0]] = np.flatnonzero(piece == 0)
    devs = d.tolist()
    return KeptReplicas(
        kept=kept_r.tolist(),
        devices=d,
        piece=piece,
        position=position.tolist(),
        costs_of=[(info.class_names[k // base], k % base) for k in distinct.tolist()],
        which=which,
        dev=devs + devs,
        dev_array=np.concatenate((d, d)),
        kind_array=np.repeat(np.array([FWD, BWD], dtype=np.int64), n),
    )


def _pieces(kept: np.ndarray, samples: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """(replica, samples, piece) of every entry: a replica with count k becomes k entries, its
    samples split as ir/accumulation.py `accumulation_pieces` splits them (the first pieces
    one sample more)."""
    replica = np.repeat(kept, counts)
    per = np.repeat(counts, counts)
    piece = np.arange(len(replica), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    base, extra = np.divmod(np.repeat(samples, counts), per)
    return replica, base + (piece < extra), piece


def block_columns(
    blk: Block,
    size: int,
    samples: list[int],
    rep: np.ndarray,
    rep_key: int,
    info: ClusterInfo,
    replica_cache: dict,
    table: CostTable,
    fresh: bool = False,
) -> BlockColumns:
    """The block's columns (BlockColumns) from its replicas' costs (_replica_costs), computed
    once per distinct (device class, samples) and spread with numpy: a 1024-replica block has
    a handful of distinct ones. `fresh`: every micro-batch's backward creates its gradients,
    as the first one does (a stage-3 sharded block frees them at each reduce-scatter,
    lower/shard_tasks.py), so the later ones are the first's."""
    kept_cache = table.caches.kept
    key = (size, blk.placement, rep_key)
    kr = kept_cache.get(key)
    if kr is None:
        make_room(kept_cache, len(blk.devices))
        kr = kept_cache[key] = _kept_replicas(blk, samples, rep, info)
    rows = []
    for dn, smp in kr.costs_of:
        ck = (blk.nodes, blk.recompute, dn, smp)
        hit = replica_cache.get(ck)
        if hit is None:
            if len(replica_cache) > 200_000:
                replica_cache.clear()
            hit = replica_cache[ck] = _replica_costs(blk, dn, smp, table)
        rows.append(hit)
    d, n = kr.devices, len(kr.devices)
    v = np.array(rows, dtype=np.float64).reshape(-1, 8)[kr.which]
    act, ws, peak_later, peak_first, grad = v[:, 2], v[:, 3], v[:, 4], v[:, 5], v[:, 6]  # see _replica_costs
    # forward: its activations and workspace; backward: up to its peak, then down to nothing;
    # micro-batch 0's backward (its first piece's) peaks at peak_first and leaves the gradients
    fwd_start = _chunk(d, act + ws, (act != 0) | (ws != 0), 0)
    fwd_end = _chunk(d, -ws, ws != 0, 0)
    creates = kr.piece == 0  # the later pieces add into the gradients their first piece made
    first = np.concatenate((v[:, 0], np.where(creates, v[:, 1], v[:, 1] + v[:, 7])))
    dur = first if fresh else np.concatenate((v[:, 0], v[:, 1] + v[:, 7]))
    first_at_start = _joined(
        fwd_start, _chunk(d, np.where(creates, peak_first, peak_later) - act, creates | (peak_later != act), n)
    )
    first_at_end = _joined(fwd_end, _chunk(d, np.where(creates, grad - peak_first, -peak_later), None, n))
    return BlockColumns(
        kept=kr.kept,
        kept_dev=d,
        piece=kr.piece,
        position=kr.position,
        dev=kr.dev,
        dur=dur.tolist(),
        dev_array=kr.dev_array,
        dur_array=dur,
        kind_array=kr.kind_array,
        first_dur=first.tolist(),
        first_dur_array=first,
        at_start=first_at_start if fresh else _joined(fwd_start, _chunk(d, peak_later - act, peak_later != act, n)),
        at_end=first_at_end if fresh else _joined(fwd_end, _chunk(d, -peak_later, peak_later != 0, n)),
        first_at_start=first_at_start,
        first_at_end=first_at_end,
    )


def _distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_inverse=True) for small non-negative ints, without sorting."""
    present = np.bincount(keys) > 0 if len(keys) else np.zeros(0, dtype=bool)
    distinct = np.flatnonzero(present)
    index = np.zeros(len(present), dtype=np.int64)
    index[distinct] = np.arange(len(distinct))
    return distinct, index[keys]


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
     micro-batch, whose gradients appear meanwhile, gradient bytes, the time a later
     micro-batch's backward takes to add its gradients into those held).

    The backward is walked group by group in reverse (PyTorch frees a group's saved
    activations after its backward; with zero_grad(set_to_none=True) its gradients appear
    then): while group k runs, the activations of groups ≤ k (group k's in full when it
    recomputes), the gradients of groups ≥ k and k's workspace are alive.
    """
    fwd = bwd = 0.0
    acts, fulls, grads, wss = [], [], [], []
    accumulate = 0.0
    for nodes in blk.nodes:
        accumulate += table.accumulate_s(nodes, dn)
        f_s, b_s = table.times_s(nodes, dn, samples)
        fwd += f_s
        bwd += b_s + (f_s if blk.recompute else 0.0)  # recompute runs the forward again
        act = table.activation_bytes(nodes, samples, blk.recompute)
        acts.append(act)
        # recompute: in its backward a group holds its kept activations plus the largest
        # block it rebuilds (never more than its full activations)
        fulls.append(
            min(act + table.recompute_transient_bytes(nodes, samples), table.activation_bytes(nodes, samples, False))
            if blk.recompute
            else act
        )
        grads.append(table.gradient_bytes(nodes))
        wss.append(table.workspace_bytes(nodes, samples))
    act_all, grad_all = sum(acts), sum(grads)
    below = act_all  # activations of groups before k
    after = 0.0  # gradients of groups ≥ k
    peak_later = peak_first = 0.0
    for k in range(len(acts) - 1, -1, -1):
        below -= acts[k]
        after += grads[k]
        alive = below + fulls[k] + wss[k]
        peak_later = max(peak_later, alive)
        peak_first = max(peak_first, alive + after)
    return (fwd, bwd, act_all, max(wss, default=0.0), peak_later, peak_first, grad_all, accumulate)
