"""Expansion of a Plan's blocks (blocks.py) into the tasks of one training iteration.

Tasks, per micro-batch m and block b with replica r on device d:
  F(b, m, r)  forward on d at the replica's integer samples (plan.replica_samples),
  B(b, m, r)  backward (plus a second forward when the group recomputes activations),
  X           re-partition transfers: replicas own contiguous sample ranges in order, so the
              samples replica i of a producer block shares with replica j of a consumer move
              i → j (activations forward, their gradients backward) over cluster.path,
  S(b)        gradient sync of a replicated block after all its backwards of all micro-batches,
  O(d)        the optimizer step of device d after its syncs.
Arrays are flat lists indexed by task id so the event loops touch no objects.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from heterog.ir.plan import Plan, split_samples
from heterog.lower.blocks import Block, block_edges, moves_between, stage_limits
from heterog.lower.context import ClusterInfo, CostTable

FWD, BWD, XFER, SYNC, OPT = 0, 1, 2, 3, 4
KIND_NAMES = ("forward", "backward", "transfer", "sync", "optimizer")


class Tasks:
    """The task graph: flat per-task lists (task id = index); `comm` holds what only
    communication tasks have. Call `seal()` after the last task is added."""

    __slots__ = ("kind", "dur", "dev", "links", "succ", "npred", "key", "mb", "comm",
                 "mem_start", "mem_end", "link_bytes", "persistent_bytes",
                 "blocks", "stage_limit", "bwd_count", "rep", "initial_bytes", "core_bytes", "sources",
                 "xfer_blocks")

    def __init__(self, blocks: list[Block], n_devices: int):
        self.kind: list[int] = []
        self.dur: list[float] = []
        self.dev: list[int] = []                 # device of a compute task, -1 for communication
        self.links: list[tuple[int, ...]] = []   # links a communication task occupies
        self.succ: list[list[int]] = []
        self.npred: list[int] = []               # filled by seal()
        self.sources: list[int] = []             # idem
        self.key: list[tuple] = []               # reference priority (phase, mb, ±block); smaller first
        self.mb: list[int] = []
        self.comm: dict[int, tuple[tuple[int, ...], float, int]] = {}  # t → (devices involved, bytes, block)
        self.mem_start: list = []                # [(device, +bytes), ...] or None
        self.mem_end: list = []
        self.link_bytes: dict[int, float] = {}
        self.persistent_bytes = [0.0] * n_devices   # parameters + gradients + optimizer state
        self.initial_bytes = [0.0] * n_devices      # memory in use when the iteration starts
        self.core_bytes: dict[int, float] = {}      # collective → bytes through a switch core
        self.blocks = blocks
        self.stage_limit = [1] * n_devices       # 1F1B: micro-batches in flight per device
        self.bwd_count: dict[tuple[int, int], int] = {}
        self.rep: list[int] = list(range(n_devices))  # device whose tasks stand for this one's
        self.xfer_blocks: dict[int, tuple[int, int]] = {}   # transfer → (producer, consumer block)

    def add(self, kind: int, dur: float, dev: int, key: tuple, mb: int) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.dur.append(dur)
        self.dev.append(dev)
        self.links.append(())
        self.succ.append([])
        self.key.append(key)
        self.mb.append(mb)
        self.mem_start.append(None)
        self.mem_end.append(None)
        return t

    def add_comm(self, kind: int, dur: float, mb: int, block: int, links: tuple[int, ...],
                 members: tuple[int, ...], nbytes: float) -> int:
        t = self.add(kind, dur, -1, (), mb)
        self.links[t] = links
        self.comm[t] = (members, nbytes, block)
        return t

    def block_of(self, t: int) -> int:
        return self.comm[t][2] if self.dev[t] < 0 else abs(self.key[t][2])

    def dep(self, a: int, b: int) -> None:
        self.succ[a].append(b)

    def mem(self, t: int, start: bool, dev: int, delta: float) -> None:
        # a new list: expand shares memory-effect lists between tasks (cached block columns,
        # replicated micro-batches), so none is changed in place
        lst = self.mem_start if start else self.mem_end
        old = lst[t]
        lst[t] = [(dev, delta)] if old is None else old + [(dev, delta)]

    def seal(self) -> None:
        npred = np.bincount(np.fromiter(chain.from_iterable(self.succ), dtype=np.intp), minlength=len(self.kind))
        self.npred = npred.tolist()
        self.sources = np.flatnonzero(npred == 0).tolist()   # tasks with no inputs, in id order


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
    nb = len(blocks)
    tasks = Tasks(blocks, len(info.devices))
    preds = block_edges(graph_grouping, blocks, table)
    devices = info.devices
    dclass = info.dev_class
    one_f1b = plan.schedule == "1f1b"
    mbs = plan.num_microbatches
    mb_sizes = split_samples(plan.batch_size, [1.0] * mbs)
    sizes = sorted(set(mb_sizes))
    splits: dict[tuple, list[int]] = {}
    for size in sizes:
        for blk in blocks:
            key = (size, blk.shares)
            if key not in splits:
                splits[key] = split_samples(size, list(blk.shares))
    # re-partition moves per micro-batch size: (src dev, dst dev, src replica, dst replica, samples, bytes)
    moves: dict[tuple[int, int, int], list] = {}
    move_cache = table.scratch.setdefault("moves", {})
    replica_cache = table.scratch.setdefault("replica", {})
    p2p_sets: list[frozenset[int]] = []     # devices that send or receive point to point
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
    rep = _representatives(blocks, splits, p2p_sets, sizes, len(devices), dclass, merge)
    tasks.rep = rep
    mem = tasks.mem
    kinds, succ, comm, lb = tasks.kind, tasks.succ, tasks.comm, tasks.link_bytes
    xfer_blocks = tasks.xfer_blocks
    # forward/backward tasks are most of the tasks: append to the columns directly
    a_kind, a_dur, a_dev, a_links = kinds.append, tasks.dur.append, tasks.dev.append, tasks.links.append
    a_succ, a_key, a_mb = tasks.succ.append, tasks.key.append, tasks.mb.append
    a_ms, a_me = tasks.mem_start.append, tasks.mem_end.append
    F = [[None] * nb for _ in range(mbs)]
    Bk = [[None] * nb for _ in range(mbs)]
    rep_key = _rep_id(table.scratch, rep)     # first: it may drop the caches below
    column_cache = table.scratch.setdefault("columns", {})
    templates: dict[int, tuple] = {}   # size → first mb's segment (see _replicate)
    first_bwd: list[tuple[int, tuple]] = []   # (first task, columns) of micro-batch 0's blocks
    for m in range(mbs):
        size = mb_sizes[m]
        if size in templates and merge:
            _replicate(tasks, templates[size], m, F, Bk)
            continue
        seg_start = len(kinds)
        lb_before = dict(lb)
        comm_before = len(comm)
        for bi, blk in enumerate(blocks):
            # a block's forwards, then its backwards, in one slice per column (the hot path);
            # the columns that depend only on the block and the merged devices are cached
            ck = (size, blk.nodes, blk.recompute, blk.devices, blk.shares, rep_key)
            cols = column_cache.get(ck)
            if cols is None:
                _make_room(column_cache, len(blk.devices))
                cols = column_cache[ck] = _block_columns(blk, splits[(size, blk.shares)], rep, dclass,
                                                         replica_cache, table)
            kept_r, devs, vs, dev2, dur2, ms2, me2, _first_ms, _first_me = cols
            n_kept = len(kept_r)
            f0 = len(kinds)
            b0 = f0 + n_kept
            kinds.extend([FWD] * n_kept)
            kinds.extend([BWD] * n_kept)
            tasks.dur.extend(dur2)
            tasks.dev.extend(dev2)
            tasks.links.extend([()] * (2 * n_kept))
            succ.extend([[b] for b in range(b0, b0 + n_kept)])
            succ.extend([[] for _ in range(n_kept)])
            tasks.key.extend([(1, m, bi) if one_f1b else (0, m, bi)] * n_kept)
            tasks.key.extend([(0, m, -bi) if one_f1b else (1, m, -bi)] * n_kept)
            tasks.mb.extend([m] * (2 * n_kept))
            tasks.mem_start.extend(ms2)     # shared lists: nothing mutates them (Tasks.mem)
            tasks.mem_end.extend(me2)
            if m == 0:
                first_bwd.append((f0, cols))
            if n_kept == len(blk.devices):
                fids = list(range(f0, b0))
                bids = list(range(b0, b0 + n_kept))
            else:
                fids = [None] * len(blk.devices)
                bids = [None] * len(blk.devices)
                for k, r in enumerate(kept_r):
                    fids[r] = f0 + k
                    bids[r] = b0 + k
            F[m][bi] = fids
            Bk[m][bi] = bids
        for bi, blk in enumerate(blocks):
            Fb, Bb = F[m][bi], Bk[m][bi]
            for a in preds[bi]:
                Fa, Ba = F[m][a], Bk[m][a]
                mv = moves[(size, a, bi)]
                if mv is None:    # identity re-partition: a merged device has no tasks (None)
                    for fa, fb, ba, bb in zip(Fa, Fb, Ba, Bb):
                        if fa is not None:
                            succ[fa].append(fb)
                            succ[bb].append(ba)
                    continue
                for da, db, i, j, nbytes, path, back, t_f, t_b in mv:
                    if rep[da] != da or rep[db] != db:
                        continue   # a merged device: its representative carries the dependency
                    fa, fb, ba, bb = Fa[i], Fb[j], Ba[i], Bb[j]
                    if path is None:          # same device, or nothing to send
                        succ[fa].append(fb)
                        succ[bb].append(ba)
                        continue
                    xf = len(kinds)
                    xb = xf + 1
                    a_kind(XFER)
                    a_kind(XFER)
                    a_dur(t_f)
                    a_dur(t_b)
                    a_dev(-1)
                    a_dev(-1)
                    a_links(path)
                    a_links(back)
                    a_succ([fb])
                    a_succ([ba])
                    a_key(())
                    a_key(())
                    a_mb(m)
                    a_mb(m)
                    # the receiver holds the tensor until the task that reads it ends
                    a_ms([(db, nbytes)])
                    a_ms([(da, nbytes)])
                    a_me(None)
                    a_me(None)
                    comm[xf] = ((da, db), nbytes, bi)
                    comm[xb] = ((db, da), nbytes, a)
                    xfer_blocks[xf] = xfer_blocks[xb] = (a, bi)
                    succ[fa].append(xf)
                    succ[bb].append(xb)
                    mem(fb, False, db, -nbytes)
                    mem(ba, False, da, -nbytes)
                    for l in path:
                        lb[l] = lb.get(l, 0.0) + nbytes
                    for l in back:
                        lb[l] = lb.get(l, 0.0) + nbytes
        templates[size] = (m, seg_start, len(kinds), {l: v - lb_before.get(l, 0.0) for l, v in lb.items()},
                           list(comm)[comm_before:])
    bwd_of_dev: dict[int, list[int]] = {}
    bwd_count = tasks.bwd_count
    for m in range(mbs):
        before = {d: len(lst) for d, lst in bwd_of_dev.items()}
        for blk, bids in zip(blocks, Bk[m]):
            for d, b in zip(blk.devices, bids):
                if b is not None:
                    lst = bwd_of_dev.get(d)
                    if lst is None:
                        bwd_of_dev[d] = [b]
                    else:
                        lst.append(b)
        for d, lst in bwd_of_dev.items():
            if len(lst) > before.get(d, 0):
                bwd_count[(d, m)] = len(lst) - before.get(d, 0)
    _sync_and_step(tasks, plan, blocks, info, table, Bk, bwd_of_dev, rep, preds, splits, mb_sizes)
    mem_start, mem_end = tasks.mem_start, tasks.mem_end
    for f0, cols in first_bwd:
        # micro-batch 0's backward also creates the gradients (see _block_columns). Other lists,
        # since replicated micro-batches share the generic ones; a backward that received
        # gradients has the generic entry (if any) first, the transfers' entries after it.
        n_kept, generic, first_ms, first_me = len(cols[0]), cols[6], cols[7], cols[8]
        b0 = f0 + n_kept
        mem_start[b0:b0 + n_kept] = first_ms
        mem_end[b0:b0 + n_kept] = [
            fm if cur is gm else fm + (cur if gm is None else cur[1:])
            for cur, gm, fm in zip(mem_end[b0:b0 + n_kept], generic[n_kept:], first_me)]
    if one_f1b:
        for d, limit in stage_limits([blk.devices for blk in blocks]).items():
            tasks.stage_limit[d] = limit
    tasks.seal()
    return tasks


_CACHED_REPLICAS = 200_000   # replicas' entries kept in a per-call-shared cache (~100 MB at most)


def _rep_id(scratch: dict, rep: list[int]) -> int:
    """A small int for the merged-device map `rep`, a key of the caches below: hashing a
    1024-entry tuple for every block cost more than the caches saved."""
    ids = scratch.setdefault("rep_ids", {})
    rt = tuple(rep)
    hit = ids.get(rt)
    if hit is None:
        if len(ids) >= 10_000:    # ids restart: drop every entry keyed by an old one
            ids.clear()
            scratch.pop("columns", None)
            scratch.pop("buffers", None)
        hit = ids[rt] = len(ids)
    return hit


def _make_room(cache: dict, replicas: int) -> None:
    """Bound a cache of per-replica lists by the replicas it holds, not by its entries: an
    entry of a 1024-device placement weighs as much as 16 of a 64-device one. The count is
    kept in the cache under the key None."""
    held = cache.get(None, 0) + replicas
    if held > _CACHED_REPLICAS:
        cache.clear()
        held = replicas
    cache[None] = held


def _block_columns(blk: Block, samples: list[int], rep: list[int], dclass: list[str],
                   replica_cache: dict, table: CostTable) -> tuple:
    """Per-block columns of expand that depend only on the block, its samples and the merged
    devices: (kept replicas, their devices, their costs, then device, duration, memory-start
    and memory-end columns of the forwards followed by the backwards, then the memory-start and
    memory-end columns of micro-batch 0's backwards)."""
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
    # v: see _replica_costs. Forward: its activations and workspace; backward: up to its peak,
    # then down to nothing (micro-batch 0, which creates the gradients, is set in expand)
    ms2 = ([[(d, v[2] + v[3])] if v[2] or v[3] else None for d, v in zip(devs, vs)]
           + [[(d, v[4] - v[2])] if v[4] != v[2] else None for d, v in zip(devs, vs)])
    me2 = ([[(d, -v[3])] if v[3] else None for d, v in zip(devs, vs)]
           + [[(d, -v[4])] if v[4] else None for d, v in zip(devs, vs)])
    # micro-batch 0's backward: its peak is v[5] and it leaves the gradients (v[6]) behind
    first_ms = [[(d, v[5] - v[2])] for d, v in zip(devs, vs)]
    first_me = [[(d, v[6] - v[5])] for d, v in zip(devs, vs)]
    return ([r for r, _d, _dn, _s in kept], devs, vs, devs + devs,
            [v[0] for v in vs] + [v[1] for v in vs], ms2, me2, first_ms, first_me)


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
    a second expansion. Memory-effect lists are shared; nothing mutates them afterwards."""
    m0, start, end, seg_link_bytes, seg_comm = template
    off = len(tasks.kind) - start
    tasks.kind.extend(tasks.kind[start:end])
    tasks.dur.extend(tasks.dur[start:end])
    tasks.dev.extend(tasks.dev[start:end])
    tasks.links.extend(tasks.links[start:end])
    tasks.succ.extend([[x + off for x in lst] for lst in tasks.succ[start:end]])
    tasks.key.extend([(k[0], m, k[2]) if k else k for k in tasks.key[start:end]])
    tasks.mb.extend([m] * (end - start))
    tasks.mem_start.extend(tasks.mem_start[start:end])
    tasks.mem_end.extend(tasks.mem_end[start:end])
    comm = tasks.comm
    for t in seg_comm:      # the segment's communication tasks
        comm[t + off] = comm[t]
        tasks.xfer_blocks[t + off] = tasks.xfer_blocks[t]
    for l, v in seg_link_bytes.items():
        tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + v
    for bi in range(len(F[m0])):
        F[m][bi] = [x + off if x is not None else None for x in F[m0][bi]]
        Bk[m][bi] = [x + off if x is not None else None for x in Bk[m0][bi]]


def _sync_and_step(tasks: Tasks, plan: Plan, blocks: list[Block], info: ClusterInfo, table: CostTable,
                   Bk, bwd_of_dev: dict[int, list[int]], rep: list[int], preds, splits, mb_sizes) -> None:
    """Persistent state per device, gradient sync per replicated block, optimizer steps."""
    devices, dclass = info.devices, info.dev_class
    mbs = plan.num_microbatches
    opt_preds: dict[int, list[int]] = {d: [] for d in bwd_of_dev}
    opt_time: dict[int, float] = {d: 0.0 for d in bwd_of_dev}
    # parameters, gradients and optimizer state: summed per placement first, since blocks
    # of one placement (all of them, in data parallelism) add the same per-class amounts
    per_placement: dict[tuple[int, ...], dict[str, list[float]]] = {}
    state_cache = table.scratch.setdefault("state", {})   # (nodes, class) → (bytes, optimizer s)
    classes_cache = table.scratch.setdefault("classes", {})   # devices → their classes
    for blk in blocks:
        acc = per_placement.setdefault(blk.devices, {})
        classes = classes_cache.get(blk.devices)
        if classes is None:
            if len(classes_cache) > 10_000:
                classes_cache.clear()
            classes = classes_cache[blk.devices] = tuple({dclass[d] for d in blk.devices})
        for dn in classes:
            v = acc.setdefault(dn, [0.0, 0.0])
            st = state_cache.get((blk.nodes, dn))
            if st is None:
                if len(state_cache) > 100_000:
                    state_cache.clear()
                st = state_cache[(blk.nodes, dn)] = (sum(table.persistent_bytes(nodes, dn) for nodes in blk.nodes),
                                                     sum(table.optimizer_s(nodes, dn) for nodes in blk.nodes))
            v[0] += st[0]
            v[1] += st[1]
    for devs, acc in per_placement.items():
        for d in devs:
            v = acc[dclass[d]]
            tasks.persistent_bytes[d] += v[0]
            if rep[d] == d:
                opt_time[d] += v[1]
    tasks.initial_bytes = list(tasks.persistent_bytes)
    # the input batch is held by the replicas of the blocks that read it, for the whole step
    input_bytes = table.graph.input_bytes
    if input_bytes.fixed or input_bytes.per_sample:
        holders: dict[int, int] = {}
        for bi, blk in enumerate(blocks):
            if not preds[bi]:
                for r, d in enumerate(blk.devices):
                    n = sum(splits[(size, blk.shares)][r] for size in mb_sizes)
                    holders[d] = max(holders.get(d, 0), n)
        for d, n in holders.items():
            if n:
                tasks.initial_bytes[d] += input_bytes.at(n)
    ring_bytes: dict[int, list] = {}    # link loads of collectives, applied once per distinct set
    rep_key = _rep_id(table.scratch, rep)     # first: it may drop the cache below
    buffer_cache = table.scratch.setdefault("buffers", {})
    grads_of: dict[tuple[int, ...], float] = {}
    for bi, blk in enumerate(blocks):
        if blk.ps_device is not None and blk.ps_device not in blk.devices:
            for nodes in blk.nodes:   # the server keeps the parameters it serves
                held = table.persistent_bytes(nodes, dclass[blk.ps_device])
                tasks.persistent_bytes[blk.ps_device] += held
                tasks.initial_bytes[blk.ps_device] += held
        grad = sum(table.gradient_bytes(nodes) for nodes in blk.nodes)
        if grad > 0:
            # zero_grad(set_to_none=True), PyTorch's default: gradients do not exist before
            # the first backward (micro-batch 0, see expand); summed per placement
            grads_of[blk.devices] = grads_of.get(blk.devices, 0.0) + grad
        if len(blk.devices) > 1 and blk.sync != "none" and grad > 0:
            members = blk.devices
            names = info.names(members)
            if blk.sync == "ps":
                links, load = info.star(members, blk.ps_device)
                dur = table.sync_s("ps", grad, names, devices[blk.ps_device])
                involved = members if blk.ps_device in members else members + (blk.ps_device,)
            else:
                links, load = info.ring(tuple(sorted(members)))
                dur = table.sync_s(blk.sync, grad, names, None)
                involved = members
            s = tasks.add_comm(SYNC, dur, mbs, bi, links, involved, grad)
            for l in info.shared_bw:
                if l in load:   # a ring crosses the core once per node it leaves
                    tasks.core_bytes[s] = load[l] * grad
            entry = ring_bytes.get(id(load))
            if entry is None:
                ring_bytes[id(load)] = [load, grad]
            else:
                entry[1] += grad
            succ = tasks.succ
            for m in range(mbs):
                for b in Bk[m][bi]:
                    if b is not None:
                        succ[b].append(s)
            # the bucket's communication buffer on every member while it is synchronised
            # (shared lists, cached: the search re-scores the same buckets constantly)
            bk = (involved, members, grad, rep_key)
            buf = buffer_cache.get(bk)
            if buf is None:
                _make_room(buffer_cache, len(involved))
                kept = [d for d in involved if rep[d] == d]
                buf = buffer_cache[bk] = ([(d, grad) for d in kept], [(d, -grad) for d in kept],
                                          [d for d in members if rep[d] == d])
            tasks.mem_start[s], tasks.mem_end[s], kept_members = buf
            for d in kept_members:
                opt_preds[d].append(s)
    for devs, grad in grads_of.items():
        for d in devs:
            tasks.initial_bytes[d] -= grad
    for load, nbytes in ring_bytes.values():
        for l, share in load.items():
            tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + share * nbytes
    succ = tasks.succ
    for d, bl in bwd_of_dev.items():
        o = tasks.add(OPT, opt_time[d], d, (2, 0, 0), mbs)
        for b in bl:
            succ[b].append(o)
        for s in opt_preds[d]:
            succ[s].append(o)
