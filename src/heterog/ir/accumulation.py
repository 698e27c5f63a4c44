"""Per-replica gradient accumulation: the rule that says where a plan's `Replica.accumulate`
counts are well defined, and how a replica's samples split into its sequential pieces.

A replica with count k runs its share of every micro-batch as k pieces, one after another,
each forward and back, adding into the gradients the first one created (Cephalo, ICS'25: a
fast card with little memory takes a large batch share, its activations those of one piece).
The lowering (lower/columns.py), the search's estimate and the executor all split the
samples with `accumulation_pieces`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ir/plan.py imports this module
    from heterog.ir.plan import Group, Plan, Replica


def accumulate_field(g: Group) -> dict[str, list[int]]:
    """A group's JSON field `accumulate`, present only when some count is not 1."""
    counts = [r.accumulate for r in g.replicas]
    return {"accumulate": counts} if any(k != 1 for k in counts) else {}


def with_accumulation(replicas: tuple[Replica, ...], counts: list | None) -> tuple[Replica, ...]:
    """The replicas with their accumulation counts from the group's `accumulate` list."""
    if counts is None:
        return replicas
    if len(counts) != len(replicas) or not all(isinstance(k, int) and not isinstance(k, bool) for k in counts):
        raise ValueError(counts)
    return tuple(replace(r, accumulate=k) for r, k in zip(replicas, counts, strict=True))


def accumulation_error(plan: Plan) -> str | None:
    """Why the plan's accumulation counts are not well defined, or None.

    A replica's pieces run one after another on its device, each the whole way forward and
    back, and meet the other replicas only in the syncs after the last piece. That holds when
    every group has one placement — the same replicas, shares and counts: data parallelism
    over the whole model, unsharded or ZeRO-1/2 — so no re-partition transfer would have to
    cut a piece out of another device's samples. ZeRO-3 gathers each compute's parameters
    with every member, so a replica's extra pieces would need gathers the others do not join;
    a tensor-parallel set runs its computes in lockstep with its members."""
    counted = [g for g in plan.groups if any(r.accumulate != 1 for r in g.replicas)]
    if not counted:
        return None
    g = counted[0]
    where, counts = f"group {g.name!r}", [r.accumulate for r in g.replicas]
    for r in g.replicas:
        if isinstance(r.accumulate, bool) or not isinstance(r.accumulate, int) or r.accumulate < 1:
            return (
                f"{where} replica on {r.device!r}: accumulate must be an integer ≥ 1 (the sequential "
                f"pieces its share of each micro-batch runs in), found {r.accumulate!r}."
            )
    if g.shard_stage >= 3:
        return (
            f"{where}: a replica accumulates (counts {counts}) in a ZeRO-3 group; stage 3 "
            f"gathers the parameters for every compute with all members, which a replica's extra pieces "
            f"would run alone. Use shard_stage 1 or 2, or accumulate 1."
        )
    if g.tp_degree > 1:
        return (
            f"{where}: a tensor-parallel replica cannot accumulate (its members compute in lockstep); set accumulate 1."
        )
    key = [(r.device, r.share, r.accumulate) for r in g.replicas]
    for other in plan.groups:
        if [(r.device, r.share, r.accumulate) for r in other.replicas] != key:
            return (
                f"{where}: a replica accumulates (counts {counts}), but group {other.name!r} "
                f"has another placement or other counts; accumulation is defined only when every group "
                f"has the same replicas, shares and counts (data parallelism over the whole model), so "
                f"that each piece runs forward and back on its device without re-partition transfers. "
                f"Give every group the same replicas and counts, or set accumulate 1."
            )
    for m in range(plan.num_microbatches):
        for r, n in zip(g.replicas, plan.replica_samples(g, m)):
            if r.accumulate > n:
                return (
                    f"{where} replica on {r.device!r}: accumulate {r.accumulate} exceeds its {n} sample(s) "
                    f"of micro-batch {m}; every piece needs a sample. Lower it to at most {n}."
                )
    return None


def accumulation_pieces(samples: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `count` sequential pieces of `samples` (relative to the replica's
    first sample): contiguous, as even as integers allow. The simulator and the executor both
    use it. The split is plan.split_samples's with equal shares: the first pieces take one
    sample more."""
    base, extra = divmod(samples, count)
    bounds = [j * base + min(j, extra) for j in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def without_stray_counts(plan: Plan) -> Plan:
    """The plan with every count 1 where its counts are not well defined (accumulation_error):
    the search's moves change one segment's placement at a time, and a count that no longer
    stands on the whole model's one placement would make an invalid plan."""
    if accumulation_error(plan) is None:
        return plan
    groups = tuple(replace(g, replicas=tuple(replace(r, accumulate=1) for r in g.replicas)) for g in plan.groups)
    return replace(plan, groups=groups)
