"""Schedule → Program: each device's projection of the global execution order.

`lower(graph, cluster, plan, costs)` builds the full schedule (every device its own tasks,
lower/schedule.py) and writes, walking the reference order once, each task as the
instruction(s) of the device(s) it involves, each instruction's `op` its task's id: a compute
on its device, a transfer as a send on the producer's device and a receive on the consumer's,
a gradient sync as a collective on every member, the optimizer step on its device. Each
device's list is thus a projection of one global order in which every receive follows its
send and every collective comes after all that its members must do first: the Program cannot
deadlock (validate() checks it anyway).
A collective then moves up on each member to just after that member's own inputs
(`_launch_when_ready`): its launch does not block, and the simulator starts it when its inputs
are done, not when a member gets round to it.
"""

from __future__ import annotations

from dataclasses import replace

from heterog.hardware.cluster import Cluster
from heterog.ir.accumulation import accumulation_pieces
from heterog.ir.kinds import CollectiveOp, Phase, SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan, split_samples
from heterog.lower.blocks import Block, overlaps
from heterog.lower.context import SimCache
from heterog.lower.program import (
    BlockInfo,
    Collective,
    Compute,
    InputPiece,
    Instruction,
    Optimizer,
    Program,
    Recv,
    Send,
    validate,
)
from heterog.lower.schedule import Schedule, build_schedule
from heterog.lower.taskgraph import BWD, FWD, OPT, SYNC, XFER


def program_devices(plan: Plan, cluster: Cluster) -> tuple[str, ...]:
    """The ranks of a run: the plan's devices and parameter servers, in the cluster's order."""
    used = set(plan.devices()) | {g.ps_device for g in plan.groups if g.ps_device}
    return tuple(d.name for d in cluster.devices if d.name in used)


def replica_ranges(size: int, shares: tuple[float, ...]) -> list[tuple[int, int]]:
    """[lo, hi) of each replica within a micro-batch of `size`: contiguous, in replica order."""
    out, lo = [], 0
    for n in split_samples(size, list(shares)):
        out.append((lo, lo + n))
        lo += n
    return out


def lower(graph: OpGraph, cluster: Cluster, plan: Plan, costs, *, cache: SimCache | None = None) -> Program:
    """The Program of `plan` (validated)."""
    sched = build_schedule(graph, cluster, plan, costs, cache=cache, merge=False)
    prog = to_program(sched, cluster)
    validate(prog, f"program of plan for {plan.model.name!r}")
    return prog


def to_program(sched: Schedule, cluster: Cluster) -> Program:
    tasks, info, plan = sched.tasks, sched.info, sched.plan
    names = info.devices
    sizes = [plan.microbatch_size(m) for m in range(plan.num_microbatches)]
    ranges = _Ranges(sched.blocks, sizes)
    pieces = _input_pieces(sched, ranges)
    out: dict[str, list[Instruction]] = {d: [] for d in program_devices(plan, cluster)}
    tasks_of: dict[str, list[int]] = {d: [] for d in out}  # the task of each instruction
    piece_of = _pieces_of(sched)
    for t in sched.order.tolist():
        kind = tasks.kind[t]
        mem = _memory(tasks, t)
        if kind in (FWD, BWD):
            d = tasks.dev[t]
            b, m = tasks.block_of(t), tasks.mb[t]
            lo, hi = ranges.of(b, m, d)
            inputs = pieces.get((b, m, d), ())
            j = piece_of.get(t, 0)
            if sched.blocks[b].pieces:  # the replica's piece j of its range, and of its inputs
                k = sched.blocks[b].pieces[sched.blocks[b].devices.index(d)]
                lo, hi = (lo + x for x in accumulation_pieces(hi - lo, k)[j])
                inputs = _cut(inputs, lo, hi)
            alloc, free = mem.get(d, (0.0, 0.0))
            out[names[d]].append(
                Compute(
                    op=t,
                    block=b,
                    phase=Phase.FORWARD if kind == FWD else Phase.BACKWARD,
                    microbatch=m,
                    lo=lo,
                    hi=hi,
                    inputs=inputs,
                    alloc_bytes=alloc,
                    free_bytes=free,
                    piece=j,
                )
            )
        elif kind == XFER:
            _transfer(out, tasks, t, names, ranges, mem)
        elif kind == SYNC:
            _collective(out, tasks, t, sched, cluster, mem)
        elif kind == OPT:
            d = tasks.dev[t]
            alloc, free = mem.get(d, (0.0, 0.0))
            out[names[d]].append(Optimizer(op=t, alloc_bytes=alloc, free_bytes=free))
        for d in (names[tasks.dev[t]],) if kind in (FWD, BWD, OPT) else out:
            tasks_of[d].extend([t] * (len(out[d]) - len(tasks_of[d])))
    _launch_when_ready(out, tasks_of, tasks)
    blocks = tuple(
        BlockInfo(
            groups=b.groups,
            devices=info.names(b.devices),
            shares=b.shares,
            sync=SyncMethod(b.sync),
            ps_device=names[b.ps_device] if b.ps_device is not None else None,
            recompute=b.recompute,
            label=b.label,
            shard_stage=b.shard_stage,
            shards=b.shards,
        )
        for b in sched.blocks
    )
    return Program(
        devices=tuple(out),
        blocks=blocks,
        microbatch_sizes=tuple(sizes),
        instructions={d: tuple(v) for d, v in out.items()},
        initial_bytes={names[d]: float(tasks.initial_bytes[d]) for d in range(len(names)) if names[d] in out},
        plan=plan.to_dict(),
    )


def _launch_when_ready(out: dict[str, list[Instruction]], tasks_of: dict[str, list[int]], tasks) -> None:
    """Move each collective up on every member to just after the member's own last input.

    The global order lists a sync when its last input ends, on whichever device; a member
    whose own gradient was ready earlier may by then have started other work, and its list
    would launch the sync only after that — while the simulator (and a trainer) starts the
    sync when its inputs are done. A launch does not block (execute/sync.py: a background
    thread), so launching at the member's last input is safe; collectives keep their order
    among themselves on every device, as the backends require. A member with no input of
    the sync on its own list (a parameter server holding no replica) keeps its place."""
    src, dst = tasks.edges.arrays()
    preds: dict[int, set[int]] = {}
    for a, b in zip(src.tolist(), dst.tolist()):
        if tasks.kind[b] == SYNC:
            preds.setdefault(b, set()).add(a)
    for d, ins in out.items():
        tids = tasks_of[d]
        here = set(tids)
        i = 0
        while i < len(ins):
            if isinstance(ins[i], Collective):
                mine = preds.get(tids[i], set())
                j = i
                while j > 0 and not isinstance(ins[j - 1], Collective) and tids[j - 1] not in mine:
                    j -= 1
                if j < i and mine & here:  # not a member without inputs here (a server)
                    ins.insert(j, ins.pop(i))
                    tids.insert(j, tids.pop(i))
            i += 1


class _Ranges:
    """Sample ranges of every block's replicas per micro-batch (replica_ranges)."""

    def __init__(self, blocks: list[Block], sizes: list[int]):
        self.blocks, self.sizes = blocks, sizes
        self._cache: dict[tuple[int, tuple[float, ...]], list[tuple[int, int]]] = {}

    def all(self, b: int, m: int) -> list[tuple[int, int]]:
        key = (self.sizes[m], self.blocks[b].shares)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = replica_ranges(*key)
        return hit

    def of(self, b: int, m: int, device: int) -> tuple[int, int]:
        return self.all(b, m)[self.blocks[b].devices.index(device)]


def _pieces_of(sched: Schedule) -> dict[int, int]:
    """Compute task → its piece, in blocks whose replicas accumulate: a replica's entries are
    consecutive, piece by piece (lower/columns.py), so in id order its forwards (and its
    backwards) of one block and micro-batch come piece 0, 1, …"""
    tasks = sched.tasks
    if not any(b.pieces for b in sched.blocks):
        return {}
    seen: dict[tuple[int, int, int, int], int] = {}
    out: dict[int, int] = {}
    for t, kind in enumerate(tasks.kind):
        if kind in (FWD, BWD) and sched.blocks[b := tasks.block_of(t)].pieces:
            key = (b, tasks.mb[t], tasks.dev[t], kind)
            out[t] = seen[key] = seen.get(key, -1) + 1
    return out


def _cut(inputs: tuple[InputPiece, ...], lo: int, hi: int) -> tuple[InputPiece, ...]:
    """The parts of a compute's input pieces within [lo, hi): a piece's inputs from blocks of
    its own placement, which ran the same piece (ir/accumulation.py: no transfer reaches a
    replica that accumulates)."""
    out = []
    for p in inputs:
        a, b = max(p.lo, lo), min(p.hi, hi)
        if a < b:
            out.append(replace(p, lo=a, hi=b, src_lo=a))
    return tuple(out)


def _memory(tasks, t: int) -> dict[int, tuple[float, float]]:
    """device → (bytes allocated at the task's start, bytes freed at its end)."""
    out: dict[int, list[float]] = {}
    for d, delta in tasks.mem_start.of(t):
        out.setdefault(d, [0.0, 0.0])[0] += delta
    for d, delta in tasks.mem_end.of(t):
        out.setdefault(d, [0.0, 0.0])[1] -= delta
    return {d: (a, f) for d, (a, f) in out.items()}


def _transfer(out, tasks, t: int, names, ranges: _Ranges, mem) -> None:
    """A transfer task: the send on its source device, the receive on its destination."""
    (src, dst), nbytes, _ = tasks.comm[t]
    a, b = tasks.xfer_blocks[t]
    m = tasks.mb[t]
    forward = tasks.comm[t][2] == b  # a forward transfer is filed under its consumer block
    phase = Phase.FORWARD if forward else Phase.BACKWARD
    prod, cons = (src, dst) if forward else (dst, src)
    (plo, phi), (clo, chi) = ranges.of(a, m, prod), ranges.of(b, m, cons)
    lo, hi = max(plo, clo), min(phi, chi)
    common = dict(op=t, tag=t, src_block=a, dst_block=b, phase=phase, microbatch=m, lo=lo, hi=hi, nbytes=nbytes)
    s_alloc, s_free = mem.get(src, (0.0, 0.0))
    r_alloc, r_free = mem.get(dst, (0.0, 0.0))
    out[names[src]].append(Send(peer=names[dst], alloc_bytes=s_alloc, free_bytes=s_free, **common))
    out[names[dst]].append(Recv(peer=names[src], alloc_bytes=r_alloc, free_bytes=r_free, **common))


def _collective(out, tasks, t: int, sched: Schedule, cluster: Cluster, mem) -> None:
    """A sync task: the block's bucket (by its sync method) or a tied parameter's copies (ring),
    on every device involved."""
    involved, nbytes, b = tasks.comm[t]
    blk, info = sched.blocks[b], sched.info
    names = info.devices
    tie = tasks.ties.get(t)
    members = tuple(names[d] for d in info.ring_order(involved if tie else blk.devices))
    by_node: dict[str, list[str]] = {}
    for d in members:
        by_node.setdefault(cluster.node_of[d], []).append(d)
    server = names[blk.ps_device] if blk.ps_device is not None and not tie else None
    method = SyncMethod.RING if tie else SyncMethod(blk.sync)
    shard = tasks.shard_ops.get(t)
    sharded = (
        dict(
            primitive=CollectiveOp(shard.primitive),
            shards=shard.fractions,
            phase=Phase(shard.phase) if shard.phase else None,
            microbatch=shard.microbatch,
        )
        if shard is not None
        else {}
    )
    for d in involved:
        alloc, free = mem.get(d, (0.0, 0.0))
        out[names[d]].append(
            Collective(
                op=t,
                block=b,
                method=method,
                members=members,
                server=server,
                nodes=tuple(tuple(v) for v in by_node.values()),
                nbytes=nbytes,
                alloc_bytes=alloc,
                free_bytes=free,
                tie=tie,
                **sharded,
            )
        )


def _input_pieces(sched: Schedule, ranges: _Ranges) -> dict[tuple[int, int, int], tuple[InputPiece, ...]]:
    """(consumer block, micro-batch, device) → where each piece of its input comes from: the
    re-partition rule (blocks.overlaps: replicas own contiguous ranges in replica order), with
    the tag of the transfer that brings a piece from another device."""
    tasks = sched.tasks
    tag_of: dict[tuple[int, int, int, int, int], int] = {}  # (a, b, m, producer, consumer) → transfer
    grad_tag_of: dict[tuple[int, int, int, int, int], int] = {}  # idem → its gradient's transfer
    for t, (a, b) in tasks.xfer_blocks.items():
        (src, dst), _, filed_under = tasks.comm[t]
        if filed_under == b:
            tag_of[(a, b, tasks.mb[t], src, dst)] = t
        else:
            grad_tag_of[(a, b, tasks.mb[t], dst, src)] = t
    preds = _block_preds(sched)
    out: dict[tuple[int, int, int], list[InputPiece]] = {}
    for b, blk in enumerate(sched.blocks):
        for a in sorted(preds[b]):
            producer = sched.blocks[a]
            for m in range(len(ranges.sizes)):
                ra, rb = ranges.all(a, m), ranges.all(b, m)
                pos = 0
                for i, j, n in overlaps([h - lo for lo, h in ra], [h - lo for lo, h in rb]):
                    da, db = producer.devices[i], blk.devices[j]
                    key = (a, b, m, da, db)
                    remote = da != db
                    out.setdefault((b, m, db), []).append(
                        InputPiece(
                            block=a,
                            lo=pos,
                            hi=pos + n,
                            src_lo=ra[i][0],
                            tag=tag_of.get(key) if remote else None,
                            grad_tag=grad_tag_of.get(key) if remote else None,
                        )
                    )
                    pos += n
    return {k: tuple(v) for k, v in out.items()}


def _block_preds(sched: Schedule) -> list[set[int]]:
    """Blocks that feed each block (from the grouping's cross edges)."""
    block_of = {g: bi for bi, blk in enumerate(sched.blocks) for g in blk.groups}
    preds: list[set[int]] = [set() for _ in sched.blocks]
    grp = sched.grouping
    for ga, gb in grp.cross:
        a, b = block_of[ga], block_of[gb]
        if a != b:
            preds[b].add(a)
    return preds
