"""A fast, group-level estimate of one iteration under a Strategy, used to rank search moves.

The simulator (heterog.simulate) has the final word on every candidate the planner reports;
this estimate exists because the search scores thousands of moves and a 1024-GPU plan has
too many per-op events to simulate each time. It is a list schedule at group granularity:

- GPipe: all forward micro-batches, then all backward ones in reverse group order (each
  after the first adds its gradients into those held: accumulate_time_s); each
  device runs its work in that order (one queue per device), each replica starts when its
  device is free and its inputs have arrived;
- a group placed exactly like its producer reads its input locally, replica by replica;
  otherwise the batch is re-partitioned: each destination replica receives the overlap of its
  sample interval with each source replica's (alpha–beta time per pair, cost-model figures);
- gradient synchronisation of a group starts when its last backward finishes on every
  replica, on a communication queue per device (overlapping later backward compute), then
  each device runs its optimizer step;
- peak memory per device: persistent state (parameters, gradients, optimizer state) of every
  group it holds + activations of all its in-flight micro-batches (GPipe keeps them all until
  backward) + the largest workspace;
- sharded state (sharding.py, the lowering's rules): a sharded bucket's gradients are
  reduce-scattered (stage 3 after every micro-batch), the pieces gathered after the optimizer
  step (stages 1–2), which steps only the replica's piece; a stage-3 unit's parameters are
  gathered on the communication queue before its forward and its backward; each replica
  holds its pieces, and a unit in use on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from heterog.ir.kinds import CollectiveOp, PipelineSchedule, ShardStage, SyncMethod
from heterog.lower.blocks import gradient_buckets, overlaps, stage_limits
from heterog.search.problem import Placement, Problem, Strategy
from heterog.search.sharding import (
    optimizer_fraction,
    piece_counts,
    piece_samples,
    replica_state_bytes,
    shard_gathers,
    shard_time_s,
    unit_bytes,
)

INFEASIBLE_PENALTY = 10.0  # score multiplier per unit of relative memory overflow


@dataclass(frozen=True, slots=True)
class Estimate:
    iteration_time_s: float
    peak_memory_bytes: np.ndarray  # per device index
    overflow: float  # max over devices of (peak − memory) / memory, ≥ 0

    @property
    def feasible(self) -> bool:
        return self.overflow <= 0.0

    @property
    def score(self) -> float:
        """Iteration time, inflated smoothly by memory overflow so the search can climb out."""
        return self.iteration_time_s * (1.0 + INFEASIBLE_PENALTY * (self.overflow + (self.overflow > 0)))


def _repartition(
    prob: Problem, src: Placement, dst: Placement, nbytes: float
) -> tuple[float, dict[int, float], dict[int, float]]:
    """Re-partition `nbytes` from src's replicas to dst's: each destination replica receives
    the overlap of its sample interval with each source's. Returns (slowest destination's
    receive time over its own paths, bytes leaving each node, bytes entering each node)."""
    per_dest = np.zeros(len(dst.devices))
    up: dict[int, float] = {}
    down: dict[int, float] = {}
    node = prob.node_idx
    for i, j, ov in overlaps(src.shares, dst.shares):  # the lowering's re-partition rule
        si, dj = src.devices[i], dst.devices[j]
        if ov > 1e-12 and si != dj:
            lat, per_byte = prob.pair_cost(si, dj)
            per_dest[j] += lat + ov * nbytes * per_byte
            if node[si] != node[dj]:
                up[node[si]] = up.get(node[si], 0.0) + ov * nbytes
                down[node[dj]] = down.get(node[dj], 0.0) + ov * nbytes
    return float(per_dest.max(initial=0.0)), up, down


class _Nics:
    """One queue per node NIC and direction: transfers through a NIC take turns."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.up = np.zeros(len(prob.nic_s_per_byte))
        self.down = np.zeros(len(prob.nic_s_per_byte))

    def transfer(self, ready_s: float, own_s: float, up: dict[int, float], down: dict[int, float]) -> float:
        """Finish time of a transfer that may start at ready_s and alone would take own_s."""
        if not up and not down:
            return ready_s + own_s
        spb = self.prob.nic_s_per_byte
        start = max(ready_s, max((self.up[n] for n in up), default=0.0), max((self.down[n] for n in down), default=0.0))
        busy = max(
            max((b * spb[n] for n, b in up.items()), default=0.0),
            max((b * spb[n] for n, b in down.items()), default=0.0),
        )
        end = start + max(own_s, busy)
        for n in up:
            self.up[n] = end
        for n in down:
            self.down[n] = end
        return end


def _buckets(prob: Problem, P, bucket_bytes: int) -> dict[int, list[int]]:
    """group → the gradient bucket whose last backward it is (its first group): runs of
    identically placed replicated groups with gradients, cut by lower.blocks.gradient_buckets."""
    closes: dict[int, list[int]] = {}
    run: list[int] = []

    def cut() -> None:
        if run:
            for bucket in gradient_buckets(run, [float(prob.grad_bytes[g]) for g in run], bucket_bytes):
                closes[bucket[0]] = bucket
            run.clear()

    for g in range(prob.n_groups):
        if run and P[run[-1]] != P[g]:
            cut()
        if len(P[g].devices) > 1 and prob.grad_bytes[g] > 0:
            run.append(g)
    cut()
    return closes


def _compute_times(
    prob: Problem, P: tuple[Placement, ...], cls: list[np.ndarray], shares: list[np.ndarray], b_m: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each group's forward and backward time on each of its replicas (a recomputed group's
    backward runs its forward again)."""
    G = prob.n_groups
    k = [piece_counts(P[g]) for g in range(G)]  # a replica that accumulates pays each piece's fixed cost
    t_f = [prob.fwd[g, cls[g], 0] * k[g] + prob.fwd[g, cls[g], 1] * shares[g] * b_m for g in range(G)]
    t_b = [prob.bwd[g, cls[g], 0] * k[g] + prob.bwd[g, cls[g], 1] * shares[g] * b_m for g in range(G)]
    for g in range(G):
        if P[g].recompute:
            t_b[g] = t_b[g] + t_f[g]
        if P[g].accumulate:  # its later pieces add into the gradients (the lowering's rule)
            t_b[g] = t_b[g] + (k[g] - 1) * prob.accumulate_time_s[g, cls[g]]
    return t_f, t_b


def estimate(prob: Problem, s: Strategy) -> Estimate:
    """Strategy s's iteration time and per-device peak memory by the lowering's rules on
    per-group tables: forwards, backwards with their gradient syncs, the optimizer step."""
    G = prob.n_groups
    M = max(1, s.microbatches)
    b_m = prob.batch_size / M
    P = s.placements
    dev = [np.asarray(p.devices, dtype=np.int64) for p in P]
    shares = [np.asarray(p.shares) for p in P]
    cls = [prob.dev_class[d] for d in dev]
    t_f, t_b = _compute_times(prob, P, cls, shares, b_m)
    same_as = [[P[p].devices == P[g].devices and P[p].shares == P[g].shares for p in prob.preds[g]] for g in range(G)]
    xfer = _transfers(prob, P, M, b_m)
    nics = _Nics(prob)
    collective = _collectives(prob, dev, nics)
    free = np.zeros(prob.n_devices)
    closes = _buckets(prob, P, s.bucket_bytes)
    gathers = shard_gathers(prob, P, closes)  # stage 3: (group, direction) → its unit's gather

    fin_f: list[list[np.ndarray]] = [[np.zeros(0)] * M for _ in range(G)]  # set before read
    for m in range(M):
        for g in range(G):
            ready = np.zeros(len(dev[g]))
            if (g, "forward") in gathers:  # the lowering gathers a stage-3 unit's parameters first
                ready = np.maximum(ready, collective(g, 0.0, gathers[(g, "forward")]))
            for k, p in enumerate(prob.preds[g]):
                if same_as[g][k]:
                    ready = np.maximum(ready, fin_f[p][m])
                else:
                    own, up, down = xfer(p, g, (p, g))
                    ready = np.maximum(ready, nics.transfer(float(fin_f[p][m].max()), own, up, down))
            start = np.maximum(free[dev[g]], ready)
            fin = start + t_f[g]
            free[dev[g]] = fin
            fin_f[g][m] = fin
    fin_b: list[list[np.ndarray]] = [[np.zeros(0)] * M for _ in range(G)]  # set before read
    syncs: list[tuple[np.ndarray, float]] = []  # (devices, end of their gradient sync)

    def sync(bucket: list[int], m: int) -> None:
        """Synchronise a gradient bucket once its last backward is done (lower.blocks'
        bucket rule: identically placed groups, filled in backward order); a sharded one's
        reduce-scatter (lower/shard_tasks.py: stage 3 after every micro-batch)."""
        g = bucket[0]
        nbytes = float(sum(prob.grad_bytes[x] for x in bucket))
        if P[g].shard:
            t_sync = shard_time_s(prob, P[g], nbytes, CollectiveOp.REDUCE_SCATTER)
        else:
            t_sync = prob.sync_time_bytes_s(P[g], nbytes)
        syncs.append((dev[g], collective(g, max(float(fin_b[x][m].max()) for x in bucket), t_sync)))

    for m in range(M):
        for g in reversed(range(G)):
            ready = fin_f[g][m].copy()
            for c in prob.succs[g]:
                if P[c].devices == P[g].devices and P[c].shares == P[g].shares:
                    ready = np.maximum(ready, fin_b[c][m])
                else:
                    own, up, down = xfer(c, g, (g, c))  # the gradient flows back c → g
                    ready = np.maximum(ready, nics.transfer(float(fin_b[c][m].max()), own, up, down))
            if (g, "backward") in gathers:
                ready = np.maximum(ready, collective(g, 0.0, gathers[(g, "backward")]))
            start = np.maximum(free[dev[g]], ready)
            fresh = P[g].shard >= ShardStage.PARAMETERS  # the lowering's rule: no gradients held
            fin = start + (t_b[g] + prob.accumulate_time_s[g, cls[g]] if m and not fresh else t_b[g])
            free[dev[g]] = fin
            fin_b[g][m] = fin
            if g in closes and (m == M - 1 or fresh):
                sync(closes[g], m)
    end = _step_end(prob, P, dev, cls, free, syncs, closes)
    peak = _peak_memory(prob, s, dev, shares, b_m, closes)
    overflow = float(np.max((peak - prob.memory_bytes) / prob.memory_bytes))
    return Estimate(iteration_time_s=float(end.max()), peak_memory_bytes=peak, overflow=max(0.0, overflow))


def _transfers(
    prob: Problem, P: tuple[Placement, ...], M: int, b_m: float
) -> Callable[[int, int, tuple[int, int]], tuple[float, dict, dict]]:
    """xfer(a, b, edge): the re-partition from group a's layout into b's of the bytes on group
    edge `edge` (_repartition), cached on the problem: neighbouring strategies share most pairs."""
    cache = prob.repartition_cache
    if len(cache) > 50_000:
        cache.clear()

    def xfer(a: int, b: int, edge: tuple[int, int]) -> tuple[float, dict, dict]:
        key = (P[a], P[b], edge, M)
        hit = cache.get(key)
        if hit is None:
            hit = _repartition(prob, P[a], P[b], prob.edges[edge].at(b_m))
            cache[key] = hit
        return hit

    return xfer


def _collectives(prob: Problem, dev: list[np.ndarray], nics: _Nics) -> Callable[[int, float, float], float]:
    """collective(g, ready_s, t): the end of a collective of t seconds among group g's replicas,
    queued on their communication queue (and, across nodes, on their NICs)."""
    comm_free = np.zeros(prob.n_devices)
    multi_node = [len(set(prob.node_idx[d].tolist())) > 1 for d in dev]

    def collective(g: int, ready_s: float, t: float) -> float:
        begin = max(ready_s, comm_free[dev[g]].max())
        if multi_node[g]:  # a collective across nodes occupies their NICs
            nodes = {int(n): 0.0 for n in set(prob.node_idx[dev[g]].tolist())}
            done = nics.transfer(begin, t, nodes, nodes)
        else:
            done = begin + t
        comm_free[dev[g]] = done
        return done

    return collective


def _step_end(
    prob: Problem,
    P: tuple[Placement, ...],
    dev: list[np.ndarray],
    cls: list[np.ndarray],
    free: np.ndarray,
    syncs: list[tuple[np.ndarray, float]],
    closes: dict[int, list[int]],
) -> np.ndarray:
    """Each device's end of the step: after its last backward and its syncs, its optimizer
    step, and (ZeRO stages 1–2) the gather of the updated pieces."""
    G = prob.n_groups
    end = free.copy()
    for d, t in syncs:
        np.maximum.at(end, d, t)
    for g in range(G):
        end[dev[g]] += prob.opt_time_s[g, cls[g]] * optimizer_fraction(P[g])
    for bucket in closes.values():  # stages 1–2: the updated pieces gathered after the step
        unit = P[bucket[0]]
        if unit.shard and unit.shard < ShardStage.PARAMETERS:
            nbytes = float(sum(prob.param_bytes[x] for x in bucket))
            end[dev[bucket[0]]] = end[dev[bucket[0]]].max() + shard_time_s(prob, unit, nbytes, CollectiveOp.ALL_GATHER)
    return end


def _input_batch_bytes(prob: Problem, dev: list[np.ndarray], shares: list[np.ndarray]) -> np.ndarray:
    """The input batch each device holds for the whole step: its samples of every micro-batch,
    where it runs a group that reads the input (lower/sync_tasks.py `_input_batch`)."""
    held = np.zeros(prob.n_devices)
    inp = prob.graph.input_bytes
    if inp.fixed or inp.per_sample:
        for g in range(prob.n_groups):
            if not prob.preds[g]:
                np.maximum.at(held, dev[g], inp.fixed + inp.per_sample * shares[g] * prob.batch_size)
    return held


def _peak_memory(
    prob: Problem, s: Strategy, dev: list[np.ndarray], shares: list[np.ndarray], b_m: float, closes: dict
) -> np.ndarray:
    """Each device's peak bytes under strategy s: state, live activations (the schedule's
    micro-batches in flight), the largest workspace or sharded unit in use, servers' sums."""
    G, M, P = prob.n_groups, max(1, s.microbatches), s.placements
    peak = np.zeros(prob.n_devices)
    work = np.zeros(prob.n_devices)
    inflight = np.full(prob.n_devices, float(M))  # GPipe: every micro-batch's activations are live
    if s.schedule == PipelineSchedule.ONE_F_ONE_B and M > 1:  # the lowering's 1F1B window: p − s on stage s
        for device, limit in stage_limits([tuple(P[g].devices) for g in range(G)]).items():
            inflight[device] = min(M, limit)
    for g in range(G):
        samples = piece_samples(P[g], shares[g] * b_m)  # a replica that accumulates: its largest piece
        act = prob.act_per_sample[g, 1 if P[g].recompute else 0] * samples * inflight[dev[g]]
        np.add.at(peak, dev[g], replica_state_bytes(prob, g, P[g]) + act)
        np.maximum.at(work, dev[g], prob.workspace_per_sample[g] * samples)
        if P[g].sync == SyncMethod.PS and P[g].ps is not None and len(P[g].devices) > 1:
            # the server holds its copy and the sum (sync_tasks._server_state), each other
            # replica the buffer the parameters come back in
            peak[P[g].ps] += 2 * prob.grad_bytes[g]
            others = [d for d in P[g].devices if d != P[g].ps]
            np.add.at(peak, others, prob.grad_bytes[g])
    peak += _input_batch_bytes(prob, dev, shares)
    for bucket in closes.values():  # a sharded unit in use (sharding.unit_bytes)
        unit = P[bucket[0]]
        if unit.shard:
            held = bucket
            if unit.shard == ShardStage.GRADIENTS and (M > 1 or unit.accumulate):
                # the first micro-batch (or piece) creates every gradient of the placement, and
                # the reduce-scatters wait for the last (lower/shard_tasks.py): all held whole
                held = [g for g in range(G) if P[g] == unit]
            np.maximum.at(work, dev[bucket[0]], unit_bytes(prob, held, unit.shard))
    peak += work
    return peak
