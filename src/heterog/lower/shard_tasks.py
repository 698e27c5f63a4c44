"""Sharded state (ZeRO-1/2/3, FSDP) in the task graph: what each replica of a sharded block
holds, and the collectives that move its pieces. Each rule lives here once: the executor
(execute/shard.py) carries out the instructions these tasks become, the simulator times them
like every other collective, and the search's estimate calls the same functions.

Layout. A sharded block (lower/blocks.py: a gradient bucket; under stage 3 also the unit whose
parameters are gathered together, FSDP's unit) lays its parameters out flat in a fixed order,
and member i of its ring (ring order) owns the contiguous piece `shard_ranges(...)[i]` (ir/plan.py), sized
by its shard fraction. Tied parameters whose users lie in several groups stay whole on every
holder (their own all-reduce, sync_tasks.py), so the shardable part of a block is its state
less theirs. Per stage, with P, G, O that part's parameter, gradient and optimizer-state bytes
and f the replica's fraction (Rajbhandari et al., ZeRO, SC'20):

  stage 1  holds P + G + f·O. After the block's last backward its gradients are reduce-
           scattered (a flat copy of G while it runs, then the summed piece f·G stays); the
           optimizer steps the piece; then the pieces are all-gathered into the parameters
           in place (no new memory).
  stage 2  as stage 1, but the gradients are freed when the reduce-scatter starts (its flat
           copy holds them).
  stage 3  holds f·P + f·O (+ f·G from the first reduce-scatter on). Each forward and each
           backward of a micro-batch runs on parameters all-gathered for it (P, freed when the
           compute ends), and each backward's gradients are reduce-scattered into the piece's
           (FSDP2's default: every micro-batch creates and frees its gradients). A gather starts
           once the compute two before its own on every member has ended (`PREFETCH_UNITS`:
           one unit is gathered while the one before it runs, FSDP's prefetch), so at most two
           units are gathered on a device at once (compute_gathers says where members that
           order their blocks differently wait earlier).

Every member is in the collective of every piece, even one that holds no samples or no
piece (fraction 0): the ring passes through it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.ir.kinds import CollectiveOp, Phase, ShardStage
from heterog.lower.blocks import Block
from heterog.lower.caches import CostTable
from heterog.lower.context import ClusterInfo
from heterog.lower.taskgraph import BWD, FWD, ShardOp, Tasks

PREFETCH_UNITS = 1  # stage 3: units gathered ahead of the one computing (FSDP prefetches one)


class ShardedState(NamedTuple):
    """A sharded block's shardable state (bytes, on one device class) and the rest."""

    params: float  # P of the shardable part
    grads: float  # G
    optimizer: float  # O
    unsharded: float  # parameters, gradients and optimizer state of tied parameters (kept whole)


def sharded_state(blk: Block, dn: str, table: CostTable, tied_bytes: float) -> ShardedState:
    """The block's state on device class `dn`, split into its shardable part and the part
    that stays whole (the tied parameters the block owns, `tied_bytes` of parameters)."""
    params = sum(table.parameter_bytes(nodes, dn) for nodes in blk.nodes)
    grads = sum(table.gradient_bytes(nodes) for nodes in blk.nodes)
    opt = sum(table.optimizer_state_bytes(nodes, dn) for nodes in blk.nodes)
    keep = min(tied_bytes / params, 1.0) if params > 0 else 0.0
    s = 1.0 - keep
    return ShardedState(params=s * params, grads=s * grads, optimizer=s * opt, unsharded=keep * (params + grads + opt))


def replica_bytes(stage: int, fraction: float, st: ShardedState) -> float:
    """What one replica holds of a sharded block at the start of an iteration, gradients
    included (sync_tasks subtracts them: they exist only from the first backward on)."""
    params = fraction * st.params if stage >= ShardStage.PARAMETERS else st.params
    return st.unsharded + params + st.grads + fraction * st.optimizer


def ring_fractions(blk: Block, info: ClusterInfo) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The block's members in ring order and each one's shard fraction in that order."""
    ring = tuple(info.ring_order(blk.devices))
    of = dict(zip(blk.devices, blk.shards))
    return ring, tuple(of[d] for d in ring)


def persistent_state(
    tasks: Tasks, blk: Block, info: ClusterInfo, table: CostTable, rep: list[int], tied_bytes: float
) -> dict[int, float]:
    """Add what every replica of a sharded block holds (tasks.persistent_bytes); return each
    replica's optimizer-step time (it steps its piece only, and the whole tied part)."""
    opt_time: dict[int, float] = {}
    for d, f in zip(blk.devices, blk.shards):
        dn = info.dev_class[d]
        st = sharded_state(blk, dn, table, tied_bytes)
        tasks.persistent_bytes[d] += replica_bytes(blk.shard_stage, f, st)
        if rep[d] == d:
            whole = sum(table.optimizer_s(nodes, dn) for nodes in blk.nodes)
            total = st.params + st.unsharded
            kept = (st.unsharded / total if total > 0 else 0.0) + f * (st.params / total if total > 0 else 0.0)
            opt_time[d] = whole * kept
    return opt_time


def _shard_task(
    tasks: Tasks,
    info: ClusterInfo,
    table: CostTable,
    blk: Block,
    b: int,
    op: CollectiveOp,
    nbytes: float,
    mb: int,
    phase: Phase | None = None,
    microbatch: int | None = None,
) -> int:
    """A reduce-scatter or all-gather task of block b over its ring, timed and loaded on the
    links with its uneven pieces."""
    ring, fractions = ring_fractions(blk, info)
    key = "reduce_scatter" if op is CollectiveOp.REDUCE_SCATTER else "all_gather"
    dur = table.shard_sync_s(key, nbytes, info.names(ring), fractions)
    links, load = info.shard_ring(ring, fractions, key)
    t = tasks.add_sync(dur, mb, b, links, load, blk.devices, nbytes, info.shared_bw)
    tasks.shard_ops[t] = ShardOp(
        primitive=str(op), members=ring, fractions=fractions, phase=str(phase) if phase else None, microbatch=microbatch
    )
    return t


def shard_syncs(
    tasks: Tasks,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    Bk,
    rep: list[int],
    tied_out: dict[int, float],
    num_microbatches: int,
    opt_inputs,
    waits: list,
) -> None:
    """The gradient reduce-scatters of every sharded block: stages 1–2 once after all its
    backwards (sync_tasks._after_backwards adds those edges, via `waits`), stage 3 once per
    micro-batch after that micro-batch's backwards; the optimizer steps wait for them. Each
    member keeps a receive buffer as large as the largest piece it is sent (`receive_bytes`)."""
    scratch: dict[int, float] = {}
    for b, blk in enumerate(blocks):
        if not blk.shard_stage:
            continue
        kept = [(d, f) for d, f in zip(blk.devices, blk.shards) if rep[d] == d]
        st = sharded_state(blk, info.dev_class[blk.devices[0]], table, _param_bytes(tied_out, b))
        if st.grads <= 0:
            continue
        kept_ids = np.array([d for d, _ in kept], dtype=np.int64)
        for d, nbytes in receive_bytes(blk, info, st.grads).items():
            if rep[d] == d:
                scratch[d] = max(scratch.get(d, 0.0), nbytes)
        if blk.shard_stage < ShardStage.PARAMETERS:
            s = _shard_task(tasks, info, table, blk, b, CollectiveOp.REDUCE_SCATTER, st.grads, num_microbatches)
            for d, f in kept:
                tasks.mem(s, True, d, st.grads)  # the flat copy it reduces
                if blk.shard_stage == ShardStage.GRADIENTS:
                    tasks.mem(s, True, d, -st.grads)  # the gradients themselves go
                tasks.mem(s, False, d, f * st.grads - st.grads)  # the summed piece stays
            waits.append((s, (b,)))
            opt_inputs.add(s, kept_ids)
            continue
        tied_grads = table_grad_bytes(blk, table) - st.grads
        for m in range(num_microbatches):
            s = _shard_task(tasks, info, table, blk, b, CollectiveOp.REDUCE_SCATTER, st.grads, m, Phase.BACKWARD, m)
            first, n = Bk.run_of(b, m)
            for t in range(first, first + n):
                tasks.dep(t, s)
            for d, f in kept:
                # the gradients go into the flat copy; a later micro-batch's backward made the
                # tied part anew in the columns (fresh gradients), but it added into the held one
                tasks.mem(s, True, d, -(tied_grads if m else 0.0))
                tasks.mem(s, False, d, (f * st.grads if m == 0 else 0.0) - st.grads)
            opt_inputs.add(s, kept_ids)
    for d, nbytes in scratch.items():  # kept from call to call (execute/collectives.py ScratchBuffers)
        tasks.initial_bytes[d] += nbytes
        tasks.persistent_bytes[d] += nbytes


def receive_bytes(blk: Block, info: ClusterInfo, nbytes: float) -> dict[int, float]:
    """Per member, the largest piece a reduce-scatter of `nbytes` sends it (every piece but
    its predecessor's, ir/plan.py shard_piece): the receive buffer the ring adds into."""
    ring, fractions = ring_fractions(blk, info)
    return {d: nbytes * f for d, f in zip(ring, largest_received(fractions))}


def largest_received(fractions: tuple[float, ...]) -> list[float]:
    """For each ring position i, the largest of the fractions but its predecessor's (i − 1):
    the largest, or the second largest where the predecessor owns the largest — linear in
    the members, as rings of a thousand are common."""
    n = len(fractions)
    if n <= 1:
        return [0.0] * n
    top = max(range(n), key=lambda j: fractions[j])
    second = max(fractions[j] for j in range(n) if j != top)
    return [second if (i - 1) % n == top else fractions[top] for i in range(n)]


def table_grad_bytes(blk: Block, table: CostTable) -> float:
    return sum(table.gradient_bytes(nodes) for nodes in blk.nodes)


def _param_bytes(tied_out: dict[int, float], b: int) -> float:
    return tied_out.get(b, 0.0)


def parameter_gathers(
    tasks: Tasks,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    rep: list[int],
    tied_out: dict[int, float],
    opt_of: dict[int, int],
    num_microbatches: int,
) -> None:
    """Stages 1–2: after the optimizer steps of every member, the block's updated pieces are
    all-gathered into its parameters (in place: no memory effect)."""
    for b, blk in enumerate(blocks):
        if not blk.shard_stage or blk.shard_stage >= ShardStage.PARAMETERS:
            continue
        st = sharded_state(blk, info.dev_class[blk.devices[0]], table, _param_bytes(tied_out, b))
        if st.params <= 0:
            continue
        s = _shard_task(tasks, info, table, blk, b, CollectiveOp.ALL_GATHER, st.params, num_microbatches)
        for d in blk.devices:
            if rep[d] == d and d in opt_of:
                tasks.dep(opt_of[d], s)


def compute_gathers(
    tasks: Tasks,
    order: np.ndarray,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    tied_out: dict[int, float],
    *,
    forward_only: bool = False,
) -> bool:
    """Stage 3: an all-gather of a block's parameters before each of its computes (one for
    all members), after the compute `PREFETCH_UNITS + 1` places before it on each member in
    `order` (the reference order without gathers), as each member's executor issues it.
    Members that run their blocks in the same order — data parallelism — then advance in step.
    Where members order them differently (a device in several placements) such waits can form
    a cycle; with `forward_only` each member's wait is moved back until it comes before all
    the computes the gather serves in `order`, so every edge goes forward in it and none can
    (schedule.py retries so when the first try cycles). Gathers with nothing to wait for
    start at once, in the order of their computes. The caller orders the tasks again: a
    gather makes a fast member wait for a slow one. Returns whether it added any."""
    sharded = {b for b, blk in enumerate(blocks) if blk.shard_stage >= ShardStage.PARAMETERS}
    if not sharded:
        return False
    kind, dev, key, mb = (tasks.array(c) for c in ("kind", "dev", "key", "mb"))
    rank = np.empty(len(kind), dtype=np.int64)
    rank[order] = np.arange(len(order))
    ordered = order[(dev[order] >= 0) & ((kind[order] == FWD) | (kind[order] == BWD))]
    seq: dict[int, list[int]] = {}
    position = {}
    for t, d in zip(ordered.tolist(), dev[ordered].tolist()):
        lst = seq.setdefault(d, [])
        position[t] = len(lst)
        lst.append(t)
    block_of = np.abs(key[ordered] % tasks.mb_stride - len(blocks))
    users: dict[tuple[int, int, int], list[int]] = {}  # (block, micro-batch, kind) → its computes
    for t, b in zip(ordered.tolist(), block_of.tolist()):
        if b in sharded:
            users.setdefault((b, int(mb[t]), int(kind[t])), []).append(t)
    free: dict[int, list[int]] = {}  # device → its gathers that wait for nothing, in order
    for (b, m, k), computes in users.items():
        blk = blocks[b]
        st = sharded_state(blk, info.dev_class[blk.devices[0]], table, _param_bytes(tied_out, b))
        phase = Phase.FORWARD if k == FWD else Phase.BACKWARD
        s = _shard_task(tasks, info, table, blk, b, CollectiveOp.ALL_GATHER, st.params, m, phase, m)
        first = min(int(rank[c]) for c in computes) if forward_only else len(order)
        after = [_prefetch_point(seq[int(dev[c])], position[c], rank, first) for c in computes]
        for a in after:
            if a is not None:
                tasks.dep(a, s)
        for c in computes:
            tasks.dep(s, c)
            tasks.mem(s, True, int(dev[c]), st.params)  # the gathered parameters …
            tasks.mem(c, False, int(dev[c]), -st.params)  # … live until the compute that uses them ends
        if all(a is None for a in after):
            for c in computes:
                free.setdefault(int(dev[c]), []).append(s)
    for gathers in free.values():
        for a, b in zip(gathers, gathers[1:]):
            tasks.dep(a, b)
    tasks.seal()
    return True


def _prefetch_point(seq: list[int], at: int, rank: np.ndarray, before: int) -> int | None:
    """The compute of a member's sequence whose end starts the gather for its compute at
    position `at`: PREFETCH_UNITS + 1 places back, or further back until it comes before the
    order position `before`; None when there is none."""
    i = at - 1 - PREFETCH_UNITS
    while i >= 0 and rank[seq[i]] >= before:
        i -= 1
    return seq[i] if i >= 0 else None
