"""The search's moves: each one small function from a strategy and one of its segments to a
neighbouring strategy, kept in a registry with its weight and scope.

A *segment* is a maximal run of consecutive groups with the same placement (a data-parallel
block, a pipeline stage). A move returns the strategy it was given when it does not apply.

Scopes. At hundreds of devices a move that adds or drops one device changes the iteration by
a fraction of a percent and the search would need thousands of them; so the search moves
whole *tiers* first (Problem.tiers: devices of one class on like nodes — a 1024-GPU cluster of
four types is four tiers), then refines single devices:
  TIER   – tier-set, tier-add, tier-drop, tier-resize, tier-split: a segment's devices as
           whole tiers, or a tier's count halved or doubled (whole nodes first);
  DEVICE – move, split, drop, add, nudge, reshare: single devices and samples;
  ANY    – shift (a stage boundary by one group), sync, micro, recompute, bucket (the
           gradient bucket size).
Where devices change, the batch-share LP (shares.py) re-balances the segment.

Other modules add moves with `register_move` (its weight is relative to the others'); the
registry's order is part of a seed's sequence of moves, so a module registers at import.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from heterog.ir.kinds import PipelineSchedule, SyncMethod
from heterog.search.problem import SYNC_CHOICES, Placement, Problem, Strategy
from heterog.search.shares import balanced_shares

MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)
# gradient bucket sizes (MiB) the bucket move steps along; DDP's 25 among them. Smaller buckets
# start syncing the last layers' gradients while the backward still runs, at one collective's
# latency each; a bucket never splits a group, so a model has at most one per group.
BUCKET_CHOICES_MIB = (0.5, 1, 2, 4, 8, 16, 25, 64)
BUCKET_CHOICES = tuple(int(mib * 2**20) for mib in BUCKET_CHOICES_MIB)  # in bytes, as Strategy holds them


class MoveScope(StrEnum):
    TIER = "tier"
    DEVICE = "device"
    ANY = "any"


@dataclass(kw_only=True)
class MoveContext:
    """What a move may read: the problem, the chain's random stream and its device draws."""

    prob: Problem
    rng: random.Random

    def __post_init__(self) -> None:
        fast = self.prob.speed_order
        self.fast = fast
        # devices drawn for single-device moves: faster ones more often (rank-weighted)
        self.device_weights = [1.0 / (1 + r) ** 0.5 for r in range(len(fast))]
        gb = [float(x) for x in self.prob.grad_bytes]
        self.grad_weights = gb if sum(gb) > 0 else None
        self.microbatch_choices = [m for m in MICROBATCH_CHOICES if self.prob.batch_size % m == 0]
        speed = self.prob.device_time_per_sample_s
        # tiers from fastest to slowest, drawn with the same rank weights
        self.tiers_fast = sorted(range(len(self.prob.tiers)), key=lambda t: (speed[self.prob.tiers[t][0]], t))
        self.tier_weights = [1.0 / (1 + r) ** 0.5 for r in range(len(self.tiers_fast))]

    def device(self) -> int:
        return self.rng.choices(self.fast, weights=self.device_weights)[0]

    def tier(self, among: Sequence[int] | None = None) -> int:
        pool = [(t, w) for t, w in zip(self.tiers_fast, self.tier_weights) if among is None or t in among]
        return self.rng.choices([t for t, _ in pool], weights=[w for _, w in pool])[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    name: str
    weight: float  # relative probability among the moves of the chain's phase
    scope: MoveScope
    apply: Callable[[MoveContext, Strategy, int, int], Strategy]  # (ctx, s, a, b) over segment [a, b)
    # the problems it is drawn on (None: all); elsewhere the chain's moves are as without it
    when: Callable[[Problem], bool] | None = None


MOVES: dict[str, Move] = {}


def register_move(move: Move) -> None:
    """Add a move to every chain started afterwards (a name may be registered once)."""
    if move.name in MOVES:
        raise ValueError(f"a search move named {move.name!r} is registered already; choose another name.")
    if not move.weight > 0:
        raise ValueError(f"move {move.name!r}: weight must be > 0, got {move.weight!r}.")
    MOVES[move.name] = move


# -- helpers -------------------------------------------------------------------------------


def segments(s: Strategy) -> list[tuple[int, int]]:
    out, a = [], 0
    P = s.placements
    for g in range(1, len(P) + 1):
        if g == len(P) or P[g] != P[a]:
            out.append((a, g))
            a = g
    return out


def with_placement(s: Strategy, a: int, b: int, p: Placement) -> Strategy:
    P = list(s.placements)
    P[a:b] = [p] * (b - a)
    return replace(s, placements=tuple(P))


def reshaped(
    prob: Problem,
    s: Strategy,
    a: int,
    b: int,
    devices: Sequence[int],
    sync: SyncMethod,
    ps: int | None,
    recompute: bool,
) -> Strategy:
    """Groups [a, b) on `devices`, shares from the LP, the sync kept where it still applies."""
    devs, shares = balanced_shares(
        prob, range(a, b), sorted(set(devices)), microbatches=s.microbatches, recompute=recompute
    )
    if len(devs) == 1:
        sync, ps = SyncMethod.NONE, None
    else:
        if sync == SyncMethod.NONE:
            sync = SyncMethod.RING
        if sync == SyncMethod.PS and ps not in devs:
            ps = devs[0]
        if sync != SyncMethod.PS:
            ps = None
    return with_placement(s, a, b, Placement(devs, shares, sync, ps, recompute))


def _keep(ctx: MoveContext, s: Strategy, a: int, b: int, devices: Sequence[int]) -> Strategy:
    p = s.placements[a]
    return reshaped(ctx.prob, s, a, b, devices, p.sync, p.ps, p.recompute)


def _per_tier(prob: Problem, devices: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in devices:
        out.setdefault(int(prob.tier_of[d]), []).append(d)
    return out


def _others(s: Strategy, a: int, b: int) -> set[int]:
    """Devices the groups outside [a, b) use: a tier's free devices are taken first."""
    return {d for g, p in enumerate(s.placements) if not a <= g < b for d in p.devices}


def _tier_devices(prob: Problem, tier: int, k: int, have: Sequence[int], busy: set[int]) -> list[int]:
    """k devices of `tier`: those already held first, then free ones, then busy ones (each
    in node order, so whole nodes fill first)."""
    members, have_set = prob.tiers[tier], set(have)
    held = [d for d in members if d in have_set]
    rest = [d for d in members if d not in have_set]
    ordered = held + [d for d in rest if d not in busy] + [d for d in rest if d in busy]
    return ordered[: max(1, min(k, len(members)))]


def _replica_cap(prob: Problem, s: Strategy) -> int:
    """More replicas than a micro-batch has samples leave some without work."""
    return max(1, prob.batch_size // max(1, s.microbatches))


# -- tier moves ------------------------------------------------------------------------------


def tier_set(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The segment on every device of a random set of tiers (the fastest drawn most often)."""
    prob = ctx.prob
    k = ctx.rng.randint(1, len(prob.tiers))
    chosen: list[int] = []
    while len(chosen) < k:
        t = ctx.tier([x for x in range(len(prob.tiers)) if x not in chosen])
        chosen.append(t)
    devs = [d for t in sorted(chosen) for d in prob.tiers[t]][: _replica_cap(prob, s)]
    return _keep(ctx, s, a, b, devs)


def tier_add(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """Every device of one more tier joins the segment."""
    prob, p = ctx.prob, s.placements[a]
    absent = [t for t in range(len(prob.tiers)) if t not in _per_tier(prob, p.devices)]
    if not absent:
        return s
    t = ctx.tier(absent)
    devs = [*p.devices, *_tier_devices(prob, t, len(prob.tiers[t]), (), _others(s, a, b))]
    return _keep(ctx, s, a, b, devs[: _replica_cap(prob, s)])


def tier_drop(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The segment leaves every device of one of its tiers."""
    prob, p = ctx.prob, s.placements[a]
    held = _per_tier(prob, p.devices)
    if len(held) < 2:
        return s
    t = ctx.rng.choice(sorted(held))
    return _keep(ctx, s, a, b, [d for d in p.devices if prob.tier_of[d] != t])


def tier_resize(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """One of the segment's tiers with half or twice as many devices (whole nodes first)."""
    prob, p = ctx.prob, s.placements[a]
    held = _per_tier(prob, p.devices)
    t = ctx.rng.choice(sorted(held))
    n = len(held[t])
    k = max(1, n // 2) if ctx.rng.random() < 0.5 else min(2 * n, len(prob.tiers[t]))
    if k == n:
        return s
    keep = [d for d in p.devices if prob.tier_of[d] != t]
    devs = keep + _tier_devices(prob, t, k, held[t], _others(s, a, b))
    return _keep(ctx, s, a, b, devs[: _replica_cap(prob, s)])


def tier_split(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """Cut the segment into two pipeline stages, its tiers divided between them (one tier:
    its nodes halved)."""
    prob, p = ctx.prob, s.placements[a]
    if b - a < 2 or len(p.devices) < 2:
        return s
    held = _per_tier(prob, p.devices)
    tiers = sorted(held)
    if len(tiers) > 1:
        ctx.rng.shuffle(tiers)
        cut_t = ctx.rng.randrange(1, len(tiers))
        head = [d for t in tiers[:cut_t] for d in held[t]]
        tail = [d for t in tiers[cut_t:] for d in held[t]]
    else:
        devs = held[tiers[0]]
        head, tail = devs[: len(devs) // 2], devs[len(devs) // 2 :]
    if ctx.rng.random() < 0.5:
        head, tail = tail, head
    cut = ctx.rng.randrange(a + 1, b)
    s = reshaped(prob, s, a, cut, head, p.sync, p.ps, p.recompute)
    return reshaped(prob, s, cut, b, tail, p.sync, p.ps, p.recompute)


# -- moves at any scale ----------------------------------------------------------------------


def shift(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """A stage boundary moves by one group: the segment's first or last group takes its
    neighbour's placement."""
    G = ctx.prob.n_groups
    ends = [g for g in ((a - 1, a), (b, b - 1)) if 0 <= g[0] < G]
    if not ends:
        return s
    src, dst = ctx.rng.choice(ends)
    return with_placement(s, dst, dst + 1, s.placements[src])


def sync(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    p = s.placements[a]
    if len(p.devices) < 2:
        return s
    method = ctx.rng.choice(SYNC_CHOICES)
    ps = ctx.rng.choice(p.devices) if method == SyncMethod.PS else None
    if method != SyncMethod.RING:  # sharded state syncs by ring reduce-scatter and all-gather only
        p = replace(p, shard=0, shards=())
    return with_placement(s, a, b, replace(p, sync=method, ps=ps))


def micro(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The number of micro-batches, or the schedule (GPipe / 1F1B)."""
    if ctx.rng.random() < 0.3:
        flipped = PipelineSchedule.ONE_F_ONE_B if s.schedule == PipelineSchedule.GPIPE else PipelineSchedule.GPIPE
        return replace(s, schedule=flipped)
    return replace(s, microbatches=ctx.rng.choice(ctx.microbatch_choices))


def bucket(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """The gradient bucket size: mostly the next size up or down, sometimes any (the time is
    not monotone in it: a bucket boundary that moves past a group's backward can cost)."""
    if s.bucket_bytes in BUCKET_CHOICES and ctx.rng.random() < 0.7:
        i = BUCKET_CHOICES.index(s.bucket_bytes) + ctx.rng.choice((-1, 1))
        return replace(s, bucket_bytes=BUCKET_CHOICES[min(max(i, 0), len(BUCKET_CHOICES) - 1)])
    return replace(s, bucket_bytes=ctx.rng.choice(BUCKET_CHOICES))


def _syncs(prob: Problem) -> bool:
    """Whether the problem has gradients to synchronise between devices (the bucket move's)."""
    return prob.n_devices > 1 and float(prob.grad_bytes.sum()) > 0


def recompute(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    p = s.placements[a]
    return reshaped(ctx.prob, s, a, b, p.devices, p.sync, p.ps, not p.recompute)


# -- device moves ----------------------------------------------------------------------------


def move(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """One group (or the segment) on a single device (model parallelism)."""
    prob, rng = ctx.prob, ctx.rng
    r = rng.random()
    if r < 0.3:
        a = rng.randrange(prob.n_groups)
        b = a + 1
    elif r < 0.6 and ctx.grad_weights is not None:
        # parameter-heavy groups are where leaving data parallelism pays (HeteroG's VGG
        # result: fully connected layers on one device, convolutions replicated)
        a = rng.choices(range(prob.n_groups), weights=ctx.grad_weights)[0]
        b = a + 1
    return reshaped(prob, s, a, b, [ctx.device()], SyncMethod.NONE, None, s.placements[a].recompute)


def split(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """Cut the segment and give its tail a random part of the devices (a new stage)."""
    p = s.placements[a]
    if b - a < 2 or len(p.devices) < 2:
        return s
    cut = ctx.rng.randrange(a + 1, b)
    devs = list(p.devices)
    half = ctx.rng.randrange(1, len(devs))
    s = reshaped(ctx.prob, s, a, cut, devs[:half], p.sync, p.ps, p.recompute)
    return reshaped(ctx.prob, s, cut, b, devs[half:], p.sync, p.ps, p.recompute)


def drop(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    p = s.placements[a]
    if len(p.devices) < 2:
        return s
    devs = list(p.devices)
    devs.remove(ctx.rng.choice(devs))
    return _keep(ctx, s, a, b, devs)


def add(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    prob, p = ctx.prob, s.placements[a]
    have = set(p.devices)
    free = [d for d in range(prob.n_devices) if d not in have]
    if not free:
        return s
    # several at once on big clusters, so a block can grow in reasonable time
    k = 1 if len(free) < 16 else ctx.rng.randint(1, max(1, len(free) // 4))
    return _keep(ctx, s, a, b, [*p.devices, *ctx.rng.sample(free, k)])


def nudge(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    """One or two samples of a micro-batch between two replicas: the LP balances compute
    only, and transfers or memory, which it does not see, may differ between devices."""
    prob, p = ctx.prob, s.placements[a]
    if len(p.devices) < 2:
        return s
    i, j = ctx.rng.sample(range(len(p.devices)), 2)
    mb = prob.batch_size // s.microbatches if prob.batch_size % s.microbatches == 0 else prob.batch_size
    step = min(p.shares[i], ctx.rng.randint(1, 2) / mb)
    shares = list(p.shares)
    shares[i] -= step
    shares[j] += step
    keep = [k for k in range(len(shares)) if shares[k] > 1e-9]
    total = sum(shares[k] for k in keep)
    devs = tuple(p.devices[k] for k in keep)
    multi = len(devs) > 1
    ps = (p.ps if p.ps in devs else devs[0]) if multi and p.sync == SyncMethod.PS else None
    new_p = Placement(
        devs, tuple(shares[k] / total for k in keep), p.sync if multi else SyncMethod.NONE, ps, p.recompute
    )
    return with_placement(s, a, b, new_p)


def reshare(ctx: MoveContext, s: Strategy, a: int, b: int) -> Strategy:
    return _keep(ctx, s, a, b, s.placements[a].devices)


for _move in (
    Move(name="tier-set", weight=2, scope=MoveScope.TIER, apply=tier_set),
    Move(name="tier-add", weight=2, scope=MoveScope.TIER, apply=tier_add),
    Move(name="tier-drop", weight=2, scope=MoveScope.TIER, apply=tier_drop),
    Move(name="tier-resize", weight=3, scope=MoveScope.TIER, apply=tier_resize),
    Move(name="tier-split", weight=2, scope=MoveScope.TIER, apply=tier_split),
    Move(name="shift", weight=3, scope=MoveScope.ANY, apply=shift),
    Move(name="sync", weight=2, scope=MoveScope.ANY, apply=sync),
    Move(name="micro", weight=1, scope=MoveScope.ANY, apply=micro),
    Move(name="recompute", weight=1, scope=MoveScope.ANY, apply=recompute),
    Move(name="bucket", weight=1, scope=MoveScope.ANY, apply=bucket, when=_syncs),
    Move(name="move", weight=3, scope=MoveScope.DEVICE, apply=move),
    Move(name="split", weight=2, scope=MoveScope.DEVICE, apply=split),
    Move(name="drop", weight=2, scope=MoveScope.DEVICE, apply=drop),
    Move(name="add", weight=2, scope=MoveScope.DEVICE, apply=add),
    Move(name="nudge", weight=1, scope=MoveScope.DEVICE, apply=nudge),
    Move(name="reshare", weight=1, scope=MoveScope.DEVICE, apply=reshare),
):
    register_move(_move)
