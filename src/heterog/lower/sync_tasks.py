"""The once-per-iteration part of the task graph: what each device holds (parameters,
gradients, optimizer state, the input batch, a server's copy), a gradient sync task per
replicated block (its collective over the members, or the parameter server; a sharded
block's reduce-scatters and gathers, shard_tasks.py), one per tied
parameter whose users lie in several groups (a ring all-reduce over every device holding a
copy, as the executor sums the copies' gradients), and each device's optimizer step after its
backwards and syncs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import Plan
from heterog.lower.blocks import Block
from heterog.lower.caches import CostTable
from heterog.lower.context import ClusterInfo, id_runs
from heterog.lower.shard_tasks import parameter_gathers, persistent_state, shard_syncs
from heterog.lower.taskgraph import OPT, Tasks, make_room


def sync_and_step(
    tasks: Tasks,
    plan: Plan,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    Bk,
    bwd_of_dev: dict[int, np.ndarray],
    rep: list[int],
    preds,
    splits,
    mb_sizes,
) -> None:
    """Persistent state per device, gradient sync per replicated block (a sharded one's
    reduce-scatters, shard_tasks.py), optimizer steps, and a sharded block's gather of its
    updated pieces after them."""
    where = _placement_of_tied_nodes(blocks, table)
    split = _split_ties(table, where)
    tied_out = _tied_bytes(split)
    opt_time = _persistent_state(tasks, blocks, info, table, rep, bwd_of_dev, where, tied_out)
    _input_batch(tasks, blocks, table, preds, splits, mb_sizes)
    opt_inputs = OptimizerInputs()
    waits: list[tuple[int, tuple[int, ...]]] = []  # (collective, the blocks it waits for)
    _sync_tasks(tasks, plan, blocks, info, table, Bk, rep, tied_out, opt_inputs, waits)
    shard_syncs(tasks, blocks, info, table, Bk, rep, tied_out, plan.num_microbatches, opt_inputs, waits)
    _tie_syncs(tasks, plan, blocks, info, table, Bk, rep, split, opt_inputs, waits)
    _after_backwards(tasks, Bk, waits)
    opt_preds = opt_inputs.by_device()
    # each device's optimizer step after its backwards and syncs: one chunk of edges, each
    # device's backwards then its syncs, in the order of the devices' first backwards
    before: list[np.ndarray] = []
    n_before: list[int] = []
    no_syncs = np.zeros(0, dtype=np.int64)
    opt_of: dict[int, int] = {}
    for d, bl in bwd_of_dev.items():
        opt_of[d] = tasks.add(OPT, opt_time[d], d, tasks.prio(2, 0, 0), plan.num_microbatches)
        syncs = opt_preds.get(d, no_syncs)
        before += (bl, syncs)
        n_before.append(len(bl) + len(syncs))
    if before:
        first = len(tasks.kind) - len(n_before)
        tasks.edges.add_chunk(
            0, (np.concatenate(before), np.repeat(np.arange(first, len(tasks.kind), dtype=np.int64), n_before))
        )
    parameter_gathers(tasks, blocks, info, table, rep, tied_out, opt_of, plan.num_microbatches)


class OptimizerInputs:
    """The syncs each device's optimizer step waits for, in the order they were made: kept
    per sync as its member devices (an array), grouped by device once at the end."""

    __slots__ = ("_syncs", "_devices")

    def __init__(self):
        self._syncs: list[int] = []
        self._devices: list[np.ndarray] = []

    def add(self, sync: int, devices: np.ndarray) -> None:
        self._syncs.append(sync)
        self._devices.append(devices)

    def by_device(self) -> dict[int, np.ndarray]:
        if not self._syncs:
            return {}
        devs = np.concatenate(self._devices)
        syncs = np.repeat(np.array(self._syncs, dtype=np.int64), [len(d) for d in self._devices])
        order = np.argsort(devs, kind="stable")
        uniq, first = np.unique(devs[order], return_index=True)
        groups = np.split(syncs[order], first[1:])
        return dict(zip(uniq.tolist(), groups))


def _placement_of_tied_nodes(blocks: list[Block], table: CostTable) -> dict[str, tuple[int, int]]:
    """node → (block, group) for the nodes that read a tied parameter."""
    tied = {n for tie in table.graph.ties for n in tie.nodes}
    if not tied:
        return {}
    return {
        n: (bi, g)
        for bi, blk in enumerate(blocks)
        for g, nodes in zip(blk.groups, blk.nodes)
        for n in nodes
        if n in tied
    }


def _persistent_state(
    tasks: Tasks,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    rep: list[int],
    bwd_of_dev,
    where: dict[str, tuple[int, int]],
    tied_out: dict[int, float],
) -> dict[int, float]:
    """Parameters, gradients and optimizer state on every device (tasks.persistent_bytes,
    initial_bytes); returns each device's optimizer-step time. A block synced by a parameter
    server leaves its optimizer state and update to the server (_server_state); a sharded
    block's replicas hold their pieces (shard_tasks.persistent_state)."""
    dclass = info.dev_class
    opt_time: dict[int, float] = {d: 0.0 for d in bwd_of_dev}
    # parameters, gradients and optimizer state: summed per placement first, since blocks
    # of one placement (all of them, in data parallelism) add the same per-class amounts
    per_placement: dict[tuple[int, bool], tuple[dict[str, list[float]], tuple[int, ...]]] = {}
    state_cache = table.caches.state  # (nodes, served) → class → (bytes, optimizer s)
    classes_cache = table.caches.classes  # device set → its devices' classes
    for bi, blk in enumerate(blocks):
        if blk.shard_stage:
            for d, t in persistent_state(tasks, blk, info, table, rep, tied_out.get(bi, 0.0)).items():
                if d in opt_time:
                    opt_time[d] += t
            continue
        served = _served(blk)
        acc = per_placement.setdefault((blk.device_set, served), ({}, blk.devices))[0]
        classes = classes_cache.get(blk.device_set)
        if classes is None:
            if len(classes_cache) > 10_000:
                classes_cache.clear()
            classes = classes_cache[blk.device_set] = tuple({dclass[d] for d in blk.devices})
        states = state_cache.get((blk.nodes, served))
        if states is None:
            if len(state_cache) > 20_000:
                state_cache.clear()
            states = state_cache[(blk.nodes, served)] = {}
        for dn in classes:
            v = acc.setdefault(dn, [0.0, 0.0])
            st = states.get(dn)
            if st is None:
                st = states[dn] = _replica_state(blk, dn, served, table)
            v[0] += st[0]
            v[1] += st[1]
    for acc, devs in per_placement.values():
        for d in devs:
            v = acc[dclass[d]]
            tasks.persistent_bytes[d] += v[0]
            if rep[d] == d:
                opt_time[d] += v[1]
    _tied_copies(tasks, blocks, info, table, where)
    _server_state(tasks, blocks, info, table)
    tasks.initial_bytes = list(tasks.persistent_bytes)
    return opt_time


def _served(blk: Block) -> bool:
    """Whether a parameter server syncs the block (and holds its optimizer state)."""
    return blk.sync == SyncMethod.PS and blk.ps_device is not None and len(blk.devices) > 1


def _replica_state(blk: Block, dn: str, served: bool, table: CostTable) -> tuple[float, float]:
    """(bytes a replica of the block holds, its optimizer-step time) on device class `dn`:
    parameters, gradients and optimizer state; under a parameter server no state, no step."""
    held = sum(table.persistent_bytes(nodes, dn) for nodes in blk.nodes)
    if served:
        return held - sum(table.optimizer_state_bytes(nodes, dn) for nodes in blk.nodes), 0.0
    return held, sum(table.optimizer_s(nodes, dn) for nodes in blk.nodes)


def _server_state(tasks: Tasks, blocks: list[Block], info: ClusterInfo, table: CostTable) -> None:
    """A parameter server keeps, for each block it serves, a copy of the parameters, the
    optimizer state and a buffer for the summed gradient (execute/collectives.py
    ParameterServer): what a replica would hold (persistent_bytes), beside its own replica's
    when it is one; every other replica keeps a buffer the new parameters arrive in."""
    for blk in blocks:
        if not _served(blk):
            continue
        assert blk.ps_device is not None  # a served block has its server
        dn = info.dev_class[blk.ps_device]
        tasks.persistent_bytes[blk.ps_device] += sum(table.persistent_bytes(nodes, dn) for nodes in blk.nodes)
        received = sum(table.gradient_bytes(nodes) for nodes in blk.nodes)
        for d in blk.devices:
            if d != blk.ps_device:
                tasks.persistent_bytes[d] += received


def _tied_copies(
    tasks: Tasks, blocks: list[Block], info: ClusterInfo, table: CostTable, where: dict[str, tuple[int, int]]
) -> None:
    """A tied parameter (OpGraph.ties) read by blocks on other devices than its owner's: each of
    those devices holds a copy — parameter, gradient and optimizer state — as the executor's
    partition gives it (cut/partition.py; the copies' gradients are summed every step)."""
    for tie in table.graph.ties:
        owner = set(blocks[where[tie.nodes[0]][0]].devices)
        holders = {d for n in tie.nodes for d in blocks[where[n][0]].devices} - owner
        for d in holders:
            tasks.persistent_bytes[d] += table.costs.tied_copy_bytes(tie.param_bytes, info.devices[d])


def _tied_bytes(split) -> dict[int, float]:
    """block → bytes of the split tied parameters it owns (kept out of its bucket)."""
    out: dict[int, float] = {}
    for tie, owner, _ in split:
        out[owner] = out.get(owner, 0.0) + tie.param_bytes
    return out


def tied_bytes(blocks: list[Block], table: CostTable) -> dict[int, float]:
    """_tied_bytes of the blocks' split ties, for callers after the expansion."""
    return _tied_bytes(_split_ties(table, _placement_of_tied_nodes(blocks, table)))


def _split_ties(table: CostTable, where: dict[str, tuple[int, int]]) -> list[tuple[object, int, tuple[int, ...]]]:
    """The tied parameters whose users lie in several groups, each with its owner's block and
    the blocks that read it: the executor keeps them out of the owners' gradient buckets and
    sums their copies' gradients in an all-reduce of their own (execute/sync.py)."""
    return [
        (tie, where[tie.nodes[0]][0], tuple(sorted({where[n][0] for n in tie.nodes})))
        for tie in table.graph.ties
        if len({where[n][1] for n in tie.nodes}) > 1
    ]


def _tie_syncs(
    tasks: Tasks,
    plan: Plan,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    Bk,
    rep: list[int],
    split,
    opt_inputs: OptimizerInputs,
    waits: list,
) -> None:
    """A ring all-reduce of each split tied parameter's gradient over the devices holding a
    copy, after every backward that reads it; the holders' optimizer steps wait for it."""
    for tie, owner, readers in split:
        members = tuple(sorted({d for b in readers for d in blocks[b].devices}))
        if len(members) < 2:
            continue
        nbytes = float(tie.param_bytes)
        links, load = info.ring(members)
        s = _collective(
            tasks,
            info,
            table.sync_s(SyncMethod.RING, nbytes, info.names(members), None),
            plan.num_microbatches,
            owner,
            links,
            load,
            members,
            nbytes,
            readers,
            waits,
        )
        tasks.ties[s] = tie.param
        kept = [d for d in members if rep[d] == d]
        for d in kept:  # the gradient's sync buffer
            tasks.mem(s, True, d, nbytes)
            tasks.mem(s, False, d, -nbytes)
        opt_inputs.add(s, np.array(kept, dtype=np.int64))


def _collective(
    tasks: Tasks,
    info: ClusterInfo,
    dur: float,
    mbs: int,
    block: int,
    links,
    load: dict[int, float],
    involved: tuple[int, ...],
    nbytes: float,
    after: tuple[int, ...],
    waits: list,
) -> int:
    """A gradient collective's task, to run after every backward of the blocks `after`
    (edges added by _after_backwards), with the bytes it pushes through switch cores and its
    link loads (tasks.sync_loads)."""
    s = tasks.add_sync(dur, mbs, block, links, load, involved, nbytes, info.shared_bw)
    waits.append((s, after))
    return s


def _after_backwards(tasks: Tasks, Bk, waits: list[tuple[int, tuple[int, ...]]]) -> None:
    """Edges from every backward (all micro-batches) of the blocks each collective waits for
    to the collective, as one chunk in the order the collectives were made."""
    firsts, counts, syncs = [], [], []
    for _, after in waits:
        n_s = 0
        for first, n in Bk.runs(after):
            firsts.append(first)
            counts.append(n)
            n_s += n
        syncs.append(n_s)
    if not waits:
        return
    src = id_runs(firsts, counts)
    tasks.edges.add_chunk(0, (src, np.repeat(np.array([s for s, _ in waits], dtype=np.int64), syncs)))


def _input_batch(tasks: Tasks, blocks: list[Block], table: CostTable, preds, splits, mb_sizes) -> None:
    """The input batch is held by the replicas of the blocks that read it, for the whole step."""
    input_bytes = table.graph.input_bytes
    if input_bytes.fixed or input_bytes.per_sample:
        holders: dict[int, int] = {}
        for bi, blk in enumerate(blocks):
            if not preds[bi]:
                for r, d in enumerate(blk.devices):
                    n = sum(splits[(size, blk.placement)][r] for size in mb_sizes)
                    holders[d] = max(holders.get(d, 0), n)
        for d, n in holders.items():
            if n:
                tasks.initial_bytes[d] += input_bytes.at(n)


def _sync_tasks(
    tasks: Tasks,
    plan: Plan,
    blocks: list[Block],
    info: ClusterInfo,
    table: CostTable,
    Bk,
    rep: list[int],
    tied_out: dict[int, float],
    opt_inputs: OptimizerInputs,
    waits: list,
) -> None:
    """A sync task per replicated block with gradients (after all its backwards), its buffer,
    link loads and the server's copy, and the optimizer steps that wait for it (opt_inputs).
    Split tied parameters are left out of their owners' buckets (`_tie_syncs` syncs them); a
    sharded block's gradients are reduce-scattered instead (shard_tasks.shard_syncs)."""
    mbs = plan.num_microbatches
    rep_key = table.caches.rep_id(rep)  # first: it may empty the cache below
    bucket_cache = table.caches.buckets
    grads_of: dict[int, list] = {}
    for bi, blk in enumerate(blocks):
        grad = sum(table.gradient_bytes(nodes) for nodes in blk.nodes)
        if grad > 0:
            # zero_grad(set_to_none=True), PyTorch's default: gradients do not exist before
            # the first backward (micro-batch 0, see expand); summed per placement
            grads_of.setdefault(blk.device_set, [blk.devices, 0.0])[1] += grad
        grad_synced = grad - tied_out.get(bi, 0.0)
        if len(blk.devices) > 1 and blk.sync != SyncMethod.NONE and grad_synced > 0 and not blk.shard_stage:
            key = (
                blk.placement,
                blk.sync,
                blk.ps_device,
                grad_synced,
                rep_key,
                blk.nodes if blk.sync == SyncMethod.PS else None,
            )
            bucket = bucket_cache.get(key)
            if bucket is None:  # cached: the search re-scores the same buckets constantly
                make_room(bucket_cache, len(blk.devices))
                bucket = bucket_cache[key] = _bucket_sync(blk, grad_synced, info, table, rep)
            s = _collective(
                tasks, info, bucket.dur, mbs, bi, bucket.links, bucket.load, bucket.involved, grad_synced, (bi,), waits
            )
            tasks.mem_start.add_chunk(s, bucket.buffer_start)
            tasks.mem_end.add_chunk(s, bucket.buffer_end)
            opt_inputs.add(s, bucket.kept_members)
    for devs, grad in grads_of.values():
        for d in devs:
            tasks.initial_bytes[d] -= grad


class BucketSync(NamedTuple):
    """A gradient bucket's sync as a task needs it (_bucket_sync)."""

    dur: float
    links: tuple[int, ...]
    load: dict[int, float]  # link → bytes per buffer byte
    involved: tuple[int, ...]  # members, and the server if it is not one
    buffer_start: tuple  # the communication buffer on every involved device:
    buffer_end: tuple  # effect chunks at the sync's start and end
    kept_members: np.ndarray  # members simulated (their optimizer steps wait for it)


def _bucket_sync(blk: Block, grad: float, info: ClusterInfo, table: CostTable, rep: list[int]) -> BucketSync:
    """The sync of a replicated block's `grad` bytes: a parameter server applies the update
    between gather and scatter; a collective runs over the members' ring."""
    members = blk.devices
    names = info.names(members)
    if blk.sync == SyncMethod.PS:
        server = blk.ps_device
        assert server is not None  # a parameter-server block has its server
        links, load = info.star(members, server)
        dur = table.sync_s(SyncMethod.PS, grad, names, info.devices[server]) + sum(
            table.optimizer_s(nodes, info.dev_class[server]) for nodes in blk.nodes
        )
        involved = members if server in members else members + (server,)
    else:
        links, load = info.ring(tuple(sorted(members)))
        dur = table.sync_s(blk.sync, grad, names, None)
        involved = members
    kept = [d for d in involved if rep[d] == d]
    at, held = np.zeros(len(kept), dtype=np.int64), np.array(kept, dtype=np.int64)
    return BucketSync(
        dur=dur,
        links=links,
        load=load,
        involved=involved,
        buffer_start=(at, held, np.full(len(kept), grad)),
        buffer_end=(at, held, np.full(len(kept), -grad)),
        kept_members=np.array([d for d in members if rep[d] == d], dtype=np.int64),
    )
