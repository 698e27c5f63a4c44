"""Sharded state (ZeRO-1/2/3) in the search: what a sharded placement holds and moves, the
shard fractions, and the move that changes them; and per-replica accumulation counts (what a
replica's activations are when it runs its share in pieces, the counts that fit them, and
the move that sets them).

What a replica holds and when the pieces move are the lowering's rules (lower/shard_tasks.py);
the estimate (estimate.py) reads them through `replica_state_bytes` and times the uneven ring
collectives with the cost model's `shard_collective_time_s`, as the lowering does.

Shard fractions: given the batch shares (the share LP, shares.py), the state is spread so
that the fullest device is as empty as it can be — the same minimax LP (HiGHS) over memory
instead of time:

    minimise z  subject to  (fixed_i + f_i · S) / M_i ≤ z,  Σ f_i = 1,  f_i ≥ 0

with S the shardable state, fixed_i what replica i holds besides its piece (the unsharded
part, its activations at its share, the gathered units) and M_i its memory. Cephalo's rule
(state ∝ free memory, `free_memory_fractions`) is the `zero-uneven` baseline's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import linprog

from heterog.cost.model import Collective
from heterog.ir.kinds import CollectiveOp, ShardStage, SyncMethod
from heterog.lower.shard_tasks import ShardedState, replica_bytes
from heterog.search.moves import Move, MoveContext, MoveScope, register_move, with_placement
from heterog.search.problem import Placement, Problem, Strategy

GATHERED_UNITS = 2  # stage 3: the unit computing and the one prefetched (shard_tasks.PREFETCH_UNITS + 1)
# the search's shard move, where memory binds: about 15 % of the moves beside the registry's
# others (weights 30 in all, moves.py)
SHARD_MOVE_WEIGHT = 5.0
MEMORY_BOUND = 0.25  # ... that is, where the whole state takes more than this share of a device
ACCUMULATE_MOVE_WEIGHT = 3.0  # the accumulation move, where the activations press on memory


def group_state(prob: Problem, g: int, cls: int) -> ShardedState:
    """Group g's state on device class `cls`: parameters, gradients, optimizer state."""
    params, grads = float(prob.param_bytes[g]), float(prob.grad_bytes[g])
    opt = max(float(prob.persistent_bytes[g, cls]) - params - grads, 0.0)
    return ShardedState(params=params, grads=grads, optimizer=opt, unsharded=0.0)


def peak_bytes(stage: int, f: float, st: ShardedState) -> float:
    """What a replica with fraction f holds of a sharded group at the step's peak, the end of
    the backward (the lowering's rules, lower/shard_tasks.py: replica_bytes, less the
    gradients it no longer holds whole): stage 1 all parameters and gradients and its piece
    of the optimizer state and of the summed gradients; stage 2 the gradients only as its
    piece; stage 3 pieces only (the units in use on top: `unit_bytes`)."""
    held = replica_bytes(stage, f, st) - st.grads
    return held + (st.grads + f * st.grads if stage == ShardStage.OPTIMIZER else f * st.grads)


def replica_state_bytes(prob: Problem, g: int, p: Placement) -> np.ndarray:
    """peak_bytes of group g on each replica of placement p (its full persistent state when
    p is not sharded)."""
    cls = prob.dev_class[np.asarray(p.devices, dtype=np.int64)]
    if not p.shard:
        return prob.persistent_bytes[g, cls]
    return np.array([peak_bytes(p.shard, f, group_state(prob, g, int(c))) for f, c in zip(p.shards, cls)])


def unit_bytes(prob: Problem, bucket: Sequence[int], stage: int) -> float:
    """What a unit (gradient bucket) of a sharded placement adds while it is in use: stage 2
    its flat gradients while they are reduce-scattered; stage 3 also its gathered parameters,
    twice (one unit computing, one prefetched)."""
    grads = float(sum(prob.grad_bytes[g] for g in bucket))
    if stage >= ShardStage.PARAMETERS:
        return GATHERED_UNITS * float(sum(prob.param_bytes[g] for g in bucket)) + grads
    return grads if stage == ShardStage.GRADIENTS else 0.0


def shard_time_s(prob: Problem, p: Placement, nbytes: float, op: CollectiveOp) -> float:
    """A ring reduce-scatter or all-gather of nbytes over p's replicas with its pieces: two
    cost-model calls per (devices, fractions, op) give the line (it is affine in the bytes)."""
    if len(p.devices) < 2 or nbytes <= 0:
        return 0.0
    key = ("shard", p.devices, p.shards, str(op))
    cache = prob.__dict__.setdefault("_shard_sync_cache", {})
    hit = cache.get(key)
    if hit is None:
        names = [prob.device_names[i] for i in p.devices]
        kind: Collective = "reduce_scatter" if op is CollectiveOp.REDUCE_SCATTER else "all_gather"
        t1, t2 = (prob.costs.shard_collective_time_s(kind, b, names, p.shards) for b in (1e7, 2e7))
        per_byte = max(0.0, (t2 - t1) / 1e7)
        hit = cache[key] = (max(0.0, t1 - 1e7 * per_byte), per_byte)
    return hit[0] + hit[1] * nbytes


def minimax_fractions(fixed: np.ndarray, state: float, memory: np.ndarray) -> np.ndarray:
    """Fractions f (Σ f = 1, f ≥ 0) of `state` bytes minimising max_i (fixed_i + f_i·state)/memory_i
    (the module docstring's LP)."""
    n = len(fixed)
    if n == 1 or state <= 0:
        return np.full(n, 1.0 / n)
    c = np.zeros(n + 1)
    c[-1] = 1.0
    a_ub = np.zeros((n, n + 1))
    a_ub[np.arange(n), np.arange(n)] = state / memory
    a_ub[:, -1] = -1.0
    a_eq = np.zeros((1, n + 1))
    a_eq[0, :n] = 1.0
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=-np.asarray(fixed, dtype=float) / memory,
        A_eq=a_eq,
        b_eq=[1.0],
        bounds=[(0.0, 1.0)] * n + [(None, None)],
        method="highs",
    )
    assert res.status == 0, f"shard LP failed unexpectedly: {res.message}"
    f = np.clip(res.x[:n], 0.0, None)
    return f / f.sum()


def _held_besides(prob: Problem, groups: Sequence[int], p: Placement, stage: int, microbatches: int) -> np.ndarray:
    """What each replica of p holds of `groups` besides its piece: the unsharded state (stages
    1–2: parameters and gradients), its activations at its share, the gathered units."""
    dev = np.asarray(p.devices, dtype=np.int64)
    cls = prob.dev_class[dev]
    gs = list(groups)
    held = np.zeros(len(dev))
    for g in gs:
        st = [group_state(prob, g, int(c)) for c in cls]
        held += np.array([peak_bytes(stage, 0.0, x) for x in st])
    act = prob.act_per_sample[gs, 1 if p.recompute else 0].sum()
    samples = piece_samples(p, np.asarray(p.shares) * prob.batch_size / max(microbatches, 1))
    held += act * samples * (microbatches if microbatches > 1 else 1)
    if stage >= ShardStage.PARAMETERS:
        held += GATHERED_UNITS * float(prob.param_bytes[gs].max(initial=0.0)) + float(
            prob.grad_bytes[gs].max(initial=0.0)
        )
    return held


def piece_counts(p: Placement) -> np.ndarray | float:
    """Each replica's accumulation count (1.0 when none accumulates)."""
    return np.asarray(p.accumulate, dtype=float) if p.accumulate else 1.0


def piece_samples(p: Placement, samples: np.ndarray) -> np.ndarray:
    """The samples of each replica's largest piece (its samples when it does not accumulate):
    what its activations and workspace follow (ir/accumulation.py splits as evenly as integers
    allow)."""
    return np.ceil(samples / piece_counts(p) - 1e-9) if p.accumulate else samples


def _shardable(prob: Problem, groups: Sequence[int], stage: int, cls: int) -> float:
    return sum(
        peak_bytes(stage, 1.0, group_state(prob, g, cls)) - peak_bytes(stage, 0.0, group_state(prob, g, cls))
        for g in groups
    )


def balanced_fractions(
    prob: Problem, groups: Sequence[int], p: Placement, stage: int, microbatches: int
) -> tuple[float, ...]:
    """heterog's fractions: the LP that leaves the fullest replica as empty as it can."""
    dev = np.asarray(p.devices, dtype=np.int64)
    held = _held_besides(prob, groups, p, stage, microbatches)
    state = _shardable(prob, groups, stage, int(prob.dev_class[dev[0]]))
    return tuple(float(x) for x in minimax_fractions(held, state, prob.memory_bytes[dev]))


def free_memory_fractions(
    prob: Problem, groups: Sequence[int], p: Placement, stage: int, microbatches: int
) -> tuple[float, ...]:
    """Cephalo's rule: each replica's fraction of the state proportional to the memory it has
    free besides its activations (and what stays unsharded)."""
    dev = np.asarray(p.devices, dtype=np.int64)
    free = np.maximum(prob.memory_bytes[dev] - _held_besides(prob, groups, p, stage, microbatches), 0.0)
    if free.sum() <= 0:
        free = prob.memory_bytes[dev].astype(float)
    return tuple(float(x) for x in free / free.sum())


def sharded(p: Placement, stage: int, fractions: Sequence[float]) -> Placement:
    """p with its state sharded at `stage` (ring sync) in the given fractions; stage 0 or a
    single replica: unsharded."""
    if not stage or len(p.devices) < 2:
        return Placement(p.devices, p.shares, p.sync if len(p.devices) > 1 else SyncMethod.NONE, p.ps, p.recompute)
    return Placement(p.devices, p.shares, SyncMethod.RING, None, p.recompute, int(stage), tuple(fractions))


def memory_bound(prob: Problem) -> bool:
    """Whether sharding may pay: the model's whole state (parameters, gradients, optimizer
    state) takes more than MEMORY_BOUND of some device's memory. Elsewhere it only adds
    collectives, and the search spends no moves on it."""
    whole = prob.persistent_bytes.sum(axis=0)[prob.dev_class]
    return bool(np.any(whole > MEMORY_BOUND * prob.memory_bytes))


def shard_move(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The search's move on the segment [a, b) (moves.py): another ZeRO stage, with heterog's
    fractions (balanced_fractions) or even ones; drawn only where `memory_bound`."""
    p = s.placements[a]
    if len(p.devices) < 2:
        return s
    stage = ctx.rng.choice([x for x in ShardStage if x != p.shard])
    if stage and ctx.rng.random() < 0.5:
        fractions = balanced_fractions(ctx.prob, range(a, b), p, stage, s.microbatches)
    else:
        fractions = tuple([1.0 / len(p.devices)] * len(p.devices))
    return with_placement(s, a, b, sharded(p, stage, fractions))


register_move(Move(name="shard", weight=SHARD_MOVE_WEIGHT, scope=MoveScope.ANY, apply=shard_move, when=memory_bound))


def fitting_counts(prob: Problem, p: Placement, microbatches: int) -> tuple[int, ...]:
    """Each replica's smallest accumulation count whose activations (of its largest piece, for
    every micro-batch GPipe keeps in flight) and workspace fit in the memory its state leaves
    (Cephalo's rule: a replica's memory, not its batch share, sets its activations); () when
    every count is 1. A replica that cannot fit even one sample a piece gets one per piece."""
    groups = range(prob.n_groups)
    dev = np.asarray(p.devices, dtype=np.int64)
    state: np.ndarray = np.sum([replica_state_bytes(prob, g, p) for g in groups], axis=0)
    if p.shard == ShardStage.GRADIENTS:  # accumulating, it holds every gradient whole (estimate.py)
        state = state + unit_bytes(prob, groups, p.shard)
    elif p.shard:
        state = state + max(unit_bytes(prob, [g], p.shard) for g in groups)
    per_sample = prob.act_per_sample[list(groups), 1 if p.recompute else 0].sum() * max(microbatches, 1)
    per_sample += float(prob.workspace_per_sample.max(initial=0.0))
    samples = np.rint(np.asarray(p.shares) * prob.batch_size / max(microbatches, 1))
    inp = prob.graph.input_bytes  # the input batch, held the whole step (estimate.py)
    state = state + inp.fixed + inp.per_sample * np.asarray(p.shares) * prob.batch_size
    room = np.maximum(prob.memory_bytes[dev] - state, 0.0)
    largest = np.maximum(np.floor(room / max(per_sample, 1e-9)), 1.0)  # samples of the largest piece
    counts = np.clip(np.ceil(samples / largest), 1, np.maximum(samples, 1)).astype(int)
    return tuple(int(k) for k in counts) if (counts > 1).any() else ()


def activations_bound(prob: Problem) -> bool:
    """Whether accumulation may pay: one sample's activations of the whole model, times the
    batch, take more than MEMORY_BOUND of the smallest device (elsewhere a replica's share
    fits without pieces, and the search spends no moves on them)."""
    whole = float(prob.act_per_sample[:, 0].sum()) * prob.batch_size
    return whole > MEMORY_BOUND * float(prob.memory_bytes.min())


def accumulate_move(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The search's move on data parallelism over the whole model (the only placement where
    counts are defined, ir/accumulation.py): each replica's count set so its activations fit
    (fitting_counts), or one replica's count one up or down. Elsewhere it changes nothing."""
    p = s.placements[0]
    if any(q != p for q in s.placements) or p.shard >= ShardStage.PARAMETERS:
        return s
    if ctx.rng.random() < 0.5:
        counts = fitting_counts(ctx.prob, p, s.microbatches)
    else:
        each = list(p.accumulate or [1] * len(p.devices))
        i = ctx.rng.randrange(len(each))
        each[i] = max(1, each[i] + ctx.rng.choice((-1, 1)))
        counts = tuple(each) if any(k > 1 for k in each) else ()
    return with_placement(s, 0, len(s.placements), replace(p, accumulate=counts))


register_move(
    Move(
        name="accumulate",
        weight=ACCUMULATE_MOVE_WEIGHT,
        scope=MoveScope.ANY,
        apply=accumulate_move,
        when=activations_bound,
    )
)


def optimizer_fraction(p: Placement) -> np.ndarray | float:
    """The part of a group's optimizer step each replica runs: its piece when sharded."""
    return np.asarray(p.shards) if p.shard else 1.0


def shard_gathers(prob: Problem, P: Sequence[Placement], closes: dict[int, list[int]]) -> dict[tuple[int, str], float]:
    """Stage 3: (group, 'forward' | 'backward') → the time of the gather of its unit's
    parameters, at the group that starts the unit in that direction (its first group forward,
    its last backward): the lowering gathers a unit before each of its computes."""
    out: dict[tuple[int, str], float] = {}
    for bucket in closes.values():
        p = P[bucket[0]]
        if p.shard >= ShardStage.PARAMETERS:
            t = shard_time_s(prob, p, float(sum(prob.param_bytes[g] for g in bucket)), CollectiveOp.ALL_GATHER)
            out[(bucket[0], "forward")] = t
            out[(bucket[-1], "backward")] = t
    return out
