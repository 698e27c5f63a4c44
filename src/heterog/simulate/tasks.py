"""Expansion of a Plan into the tasks of one training iteration.

Units. Groups run in a priority-respecting topological order (context.Grouping.order).
Consecutive groups in that order with the same placement (devices, shares, sync, recompute)
that exchange data with other placements only at the run's ends run back to back on every
replica with no communication between them, so they are fused into one *block*; a block is also one gradient bucket: a run is cut, walking backward, wherever its
gradients would exceed plan.bucket_bytes, so synchronisation of the later layers overlaps the
backward of the earlier ones (PyTorch DDP's bucketing, Li et al. VLDB 2020).

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

from dataclasses import dataclass

from heterog.ir.plan import Plan, split_samples
from heterog.simulate.context import ClusterInfo, CostTable

FWD, BWD, XFER, SYNC, OPT = 0, 1, 2, 3, 4
KIND_NAMES = ("forward", "backward", "transfer", "sync", "optimizer")


@dataclass(slots=True)
class Block:
    groups: tuple[int, ...]          # group indices, in execution order
    nodes: tuple[tuple[str, ...], ...]  # their node tuples (cost-cache keys)
    devices: tuple[int, ...]         # replica device ids
    shares: tuple[float, ...]
    sync: str
    ps_device: int | None
    recompute: bool
    label: str


class Tasks:
    """The task graph: flat per-task lists (task id = index)."""

    __slots__ = ("kind", "dur", "dev", "links", "succ", "npred", "key", "mb", "block",
                 "members", "nbytes", "mem_start", "mem_end", "link_bytes", "persistent_bytes",
                 "blocks", "stage_limit", "bwd_count")

    def __init__(self, blocks: list[Block], n_devices: int):
        self.kind: list[int] = []
        self.dur: list[float] = []
        self.dev: list[int] = []                 # device of a compute task, -1 for communication
        self.links: list[tuple[int, ...]] = []   # links a communication task occupies
        self.succ: list[list[int]] = []
        self.npred: list[int] = []
        self.key: list[tuple] = []               # reference-schedule priority (smaller first)
        self.mb: list[int] = []
        self.block: list[int] = []
        self.members: list[tuple[int, ...]] = []  # devices a communication task involves
        self.nbytes: list[float] = []
        self.mem_start: list = []                # [(device, +bytes), ...] or None
        self.mem_end: list = []
        self.link_bytes: dict[int, float] = {}
        self.persistent_bytes = [0.0] * n_devices
        self.blocks = blocks
        self.stage_limit = [1] * n_devices       # 1F1B: micro-batches in flight per device
        self.bwd_count: dict[tuple[int, int], int] = {}

    def add(self, kind: int, dur: float, dev: int, key: tuple, mb: int, block: int,
            links: tuple[int, ...] = (), members: tuple[int, ...] = (), nbytes: float = 0.0) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.dur.append(dur)
        self.dev.append(dev)
        self.links.append(links)
        self.succ.append([])
        self.npred.append(0)
        self.key.append(key)
        self.mb.append(mb)
        self.block.append(block)
        self.members.append(members)
        self.nbytes.append(nbytes)
        self.mem_start.append(None)
        self.mem_end.append(None)
        return t

    def dep(self, a: int, b: int) -> None:
        self.succ[a].append(b)
        self.npred[b] += 1

    def mem(self, t: int, start: bool, dev: int, delta: float) -> None:
        lst = self.mem_start if start else self.mem_end
        if lst[t] is None:
            lst[t] = [(dev, delta)]
        else:
            lst[t].append((dev, delta))


def make_blocks(plan: Plan, order: list[int], grouping, info: ClusterInfo, table: CostTable) -> list[Block]:
    """Fuse runs of groups (see the module docstring). A group joins the run before it only if
    it has the same placement, none of its inputs come from another placement, and the run's
    last group sends nothing to another placement: a fused run then receives only at its start
    and sends only at its end, so fusion delays no other device."""
    groups = plan.groups
    keys = [(g.replicas, g.sync, g.ps_device, g.recompute) for g in groups]
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
        pieces: list[list[int]] = []
        if replicated:
            acc = 0.0
            for g in reversed(run):   # buckets fill in backward order, as DDP's do
                gb = table.gradient_bytes(groups[g].nodes)
                if pieces and acc > 0 and acc + gb > plan.bucket_bytes:
                    pieces.append([])
                    acc = 0.0
                if not pieces:
                    pieces.append([])
                pieces[-1].append(g)
                acc += gb
            pieces = [list(reversed(p)) for p in reversed(pieces)]
        else:
            pieces = [run]
        for p in pieces:
            names = [groups[g].name for g in p]
            blocks.append(Block(
                groups=tuple(p), nodes=tuple(groups[g].nodes for g in p),
                devices=tuple(dev_id[r.device] for r in grp.replicas),
                shares=tuple(r.share for r in grp.replicas), sync=grp.sync,
                ps_device=dev_id[grp.ps_device] if grp.ps_device else None,
                recompute=grp.recompute,
                label=names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"))
    return blocks


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


def expand(plan: Plan, graph_grouping, blocks: list[Block], info: ClusterInfo,
           table: CostTable) -> Tasks:
    nb = len(blocks)
    tasks = Tasks(blocks, len(info.devices))
    block_of_group = {}
    for bi, b in enumerate(blocks):
        for g in b.groups:
            block_of_group[g] = bi
    # block-level edges with their (fixed, per-sample) bytes; a producer node's tensor is sent
    # once per consumer block even when several of its nodes read it
    preds: list[dict[int, tuple[float, float]]] = [dict() for _ in range(nb)]
    for (ga, gb), edges in graph_grouping.cross.items():
        a, b = block_of_group[ga], block_of_group[gb]
        if a == b:
            continue
        per_src: dict[str, tuple[float, float]] = {}
        for src, dst in edges:
            fx, ps = table.edge_bytes(src, dst)
            old = per_src.get(src)
            if old is None or fx + ps > old[0] + old[1]:
                per_src[src] = (fx, ps)
        fx0, ps0 = preds[b].get(a, (0.0, 0.0))
        preds[b][a] = (fx0 + sum(v[0] for v in per_src.values()), ps0 + sum(v[1] for v in per_src.values()))

    devices = info.devices
    dclass = info.dev_class
    one_f1b = plan.schedule == "1f1b"
    mbs = plan.num_microbatches
    mb_sizes = split_samples(plan.batch_size, [1.0] * mbs)
    split_cache: dict[tuple, list[int]] = {}
    F: list[list[list[int]]] = [[None] * nb for _ in range(mbs)]  # type: ignore[list-item]
    Bk: list[list[list[int]]] = [[None] * nb for _ in range(mbs)]  # type: ignore[list-item]
    bwd_of_dev: dict[int, list[int]] = {}
    for m in range(mbs):
        size = mb_sizes[m]
        for bi, blk in enumerate(blocks):
            sk = (size, blk.shares)
            samples = split_cache.get(sk)
            if samples is None:
                samples = split_cache[sk] = split_samples(size, list(blk.shares))
            fids, bids = [], []
            fkey = (1, m, bi) if one_f1b else (0, m, bi)
            bkey = (0, m, -bi) if one_f1b else (1, m, -bi)
            for r, d in enumerate(blk.devices):
                s = samples[r]
                dn = dclass[d]
                fwd = bwd = 0.0
                act = full = ws = 0.0
                for nodes in blk.nodes:
                    f_s, b_s = table.times_s(nodes, dn, s)
                    fwd += f_s
                    bwd += b_s + (f_s if blk.recompute else 0.0)
                    act += table.activation_bytes(nodes, s, blk.recompute)
                    if blk.recompute:
                        full += table.activation_bytes(nodes, s, False)
                    w = table.workspace_bytes(nodes, s)
                    ws = w if w > ws else ws
                f = tasks.add(FWD, fwd, d, fkey, m, bi)
                b = tasks.add(BWD, bwd, d, bkey, m, bi)
                tasks.dep(f, b)
                if act or ws:
                    tasks.mem(f, True, d, act + ws)
                if ws:
                    tasks.mem(f, False, d, -ws)
                extra = (full - act) if blk.recompute else 0.0
                if ws or extra:
                    tasks.mem(b, True, d, ws + extra)
                if act or ws or extra:
                    tasks.mem(b, False, d, -(ws + act + extra))
                fids.append(f)
                bids.append(b)
                bwd_of_dev.setdefault(d, []).append(b)
                tasks.bwd_count[(d, m)] = tasks.bwd_count.get((d, m), 0) + 1
            F[m][bi] = fids
            Bk[m][bi] = bids
        # re-partition between producer and consumer blocks
        for bi, blk in enumerate(blocks):
            ssplit = split_cache[(size, blk.shares)]
            for a, (fx, ps) in preds[bi].items():
                src = blocks[a]
                asplit = split_cache[(size, src.shares)]
                for i, j, n in overlaps(asplit, ssplit):
                    da, db = src.devices[i], blk.devices[j]
                    fa, fb = F[m][a][i], F[m][bi][j]
                    ba, bb = Bk[m][a][i], Bk[m][bi][j]
                    nbytes = fx * n / size + ps * n
                    if da == db or nbytes <= 0:
                        tasks.dep(fa, fb)
                        tasks.dep(bb, ba)
                        continue
                    path = info.path(da, db)
                    back = info.path(db, da)
                    t_f = table.transfer_s(nbytes, devices[da], devices[db])
                    t_b = table.transfer_s(nbytes, devices[db], devices[da])
                    xf = tasks.add(XFER, t_f, -1, (), m, bi, path, (da, db), nbytes)
                    xb = tasks.add(XFER, t_b, -1, (), m, a, back, (db, da), nbytes)
                    tasks.dep(fa, xf)
                    tasks.dep(xf, fb)
                    tasks.dep(bb, xb)
                    tasks.dep(xb, ba)
                    # the receiver holds the tensor until the task that reads it ends
                    tasks.mem(xf, True, db, nbytes)
                    tasks.mem(fb, False, db, -nbytes)
                    tasks.mem(xb, True, da, nbytes)
                    tasks.mem(ba, False, da, -nbytes)
                    for l in path:
                        tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + nbytes
                    for l in back:
                        tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + nbytes
    # persistent state, gradient sync and the optimizer step
    opt_preds: dict[int, list[int]] = {d: [] for d in bwd_of_dev}
    opt_time: dict[int, float] = {d: 0.0 for d in bwd_of_dev}
    for bi, blk in enumerate(blocks):
        for d in blk.devices:
            dn = dclass[d]
            for nodes in blk.nodes:
                tasks.persistent_bytes[d] += table.persistent_bytes(nodes, dn)
                opt_time[d] += table.optimizer_s(nodes, dn)
        if blk.ps_device is not None and blk.ps_device not in blk.devices:
            for nodes in blk.nodes:   # the server keeps the parameters it serves
                tasks.persistent_bytes[blk.ps_device] += table.persistent_bytes(nodes, dclass[blk.ps_device])
        grad = sum(table.gradient_bytes(nodes) for nodes in blk.nodes)
        if len(blk.devices) > 1 and blk.sync != "none" and grad > 0:
            members = blk.devices
            names = tuple(devices[d] for d in members)
            if blk.sync == "ps":
                links, load = info.star(members, blk.ps_device)
                dur = table.sync_s("ps", grad, names, devices[blk.ps_device])
                involved = members if blk.ps_device in members else members + (blk.ps_device,)
            else:
                links, load = info.ring(tuple(sorted(members)))
                dur = table.sync_s(blk.sync, grad, names, None)
                involved = members
            s = tasks.add(SYNC, dur, -1, (), mbs, bi, links, involved, grad)
            for l, share in load.items():
                tasks.link_bytes[l] = tasks.link_bytes.get(l, 0.0) + share * grad
            for m in range(mbs):
                for b in Bk[m][bi]:
                    tasks.dep(b, s)
            for d in involved:
                tasks.mem(s, True, d, grad)
                tasks.mem(s, False, d, -grad)
            for d in members:
                opt_preds[d].append(s)
    for d, bl in bwd_of_dev.items():
        o = tasks.add(OPT, opt_time[d], d, (2, 0, 0), mbs, -1)
        for b in bl:
            tasks.dep(b, o)
        for s in opt_preds[d]:
            tasks.dep(s, o)
    if one_f1b:
        _stage_limits(tasks, blocks)
    return tasks


def _stage_limits(tasks: Tasks, blocks: list[Block]) -> None:
    """1F1B: a device whose first stage is s (of p) keeps at most p − s micro-batches in
    flight (Narayanan et al., PipeDream-Flush, SC'21). A stage is a maximal run of blocks on
    the same device set."""
    stages = 0
    first: dict[int, int] = {}
    last = None
    for blk in blocks:
        ds = frozenset(blk.devices)
        if ds != last:
            stages += 1
            last = ds
        for d in blk.devices:
            first.setdefault(d, stages - 1)
    for d, s in first.items():
        tasks.stage_limit[d] = stages - s
