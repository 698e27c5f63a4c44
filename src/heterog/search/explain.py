"""Why the planner chose what it chose: notes on a Plan, and the infeasible answer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from heterog.fmt import human_bytes, human_time
from heterog.ir.kinds import PipelineSchedule, SyncMethod
from heterog.ir.plan import DEFAULT_BUCKET_BYTES, Plan
from heterog.search.problem import Placement
from heterog.search.sharding import replica_state_bytes

if TYPE_CHECKING:
    from heterog.search.bound import Bound
    from heterog.search.lanes import Candidate
    from heterog.search.problem import Problem


def _segments(plan: Plan) -> list[tuple[int, int]]:
    out, a = [], 0
    G = plan.groups
    for g in range(1, len(G) + 1):
        if g == len(G) or (G[g].replicas, G[g].sync, G[g].ps_device) != (G[a].replicas, G[a].sync, G[a].ps_device):
            out.append((a, g))
            a = g
    return out


def _kind(prob: Problem, device: str) -> str:
    """GPU type, with the slowdown of an emulated device (two 'cpu' devices may differ)."""
    d = prob.cluster.device(device)
    return d.gpu_type if d.slowdown == 1.0 else f"{d.gpu_type}/{d.slowdown:g}x-slower"


def _simulated(prob: Problem, plan: Plan):
    """The winner's simulated iteration (per-device compute and idle time), or None when the
    simulator is not available (the plan was scored by the estimate)."""
    try:
        from heterog.simulate.simulator import simulate
    except ImportError:
        return None
    return simulate(prob.graph, prob.cluster, plan, prob.costs, timeline=False, cache=prob.sim_cache)


def _percent_range(fracs: list[float]) -> str:
    lo, hi = min(fracs), max(fracs)
    return f"{lo * 100:.0f} %" if round(lo * 100) == round(hi * 100) else f"{lo * 100:.0f}–{hi * 100:.0f} %"


def _busy_note(plan: Plan, sim) -> str:
    """How much of the iteration each used device computes, from the simulation."""
    t = sim.iteration_time_s
    busy = {d: sim.compute_time_s.get(d, 0.0) / t for d in plan.devices()} if t > 0 else {}
    if not busy:
        return ""
    top = max(busy, key=busy.__getitem__)
    return (
        f"in the simulated iteration the {len(busy)} device(s) used compute {_percent_range(list(busy.values()))} "
        f"of the time (busiest: {top} at {busy[top] * 100:.0f} %); the rest they wait for inputs, "
        f"transfers and gradient syncs."
    )


def _microbatch_note(plan: Plan, segments: list[tuple[int, int]], sim) -> str:
    """What the micro-batches do here: accumulation on one stage, or a pipeline whose bubbles
    the simulation measures (the stages' compute share of the iteration)."""
    stages = list(dict.fromkeys(tuple(r.device for r in plan.groups[a].replicas) for a, _ in segments))
    m, sched = plan.num_microbatches, plan.schedule
    if len(stages) == 1:
        if sched == PipelineSchedule.ONE_F_ONE_B:
            return (
                f"{m} micro-batches accumulate gradients (1F1B on one stage): only one micro-batch's "
                f"activations are live at a time, which lowers peak memory."
            )
        return f"{m} micro-batches per iteration ({sched})."
    line = f"{m} micro-batches per iteration ({sched}) over {len(stages)} stages"
    if sim is not None and sim.iteration_time_s > 0:
        per_stage = [max(sim.compute_time_s.get(d, 0.0) for d in devs) / sim.iteration_time_s for devs in stages]
        line += (
            f"; each stage's busiest device computes {_percent_range(per_stage)} of the iteration, "
            f"the rest is pipeline fill and drain, transfers and syncs"
        )
    if sched == PipelineSchedule.ONE_F_ONE_B:
        line += "; 1F1B keeps at most p − s micro-batches in flight at stage s of p, which bounds activation memory"
    return line + "."


def _segment_note(prob: Problem, plan: Plan, a: int, b: int, speed: np.ndarray) -> str:
    g = plan.groups[a]
    span = f"groups g{a}–g{b - 1}" if b - a > 1 else f"group g{a}"
    if len(g.replicas) == 1 and g.tp_degree > 1:
        members = ", ".join(g.replicas[0].members)
        return f"{span}: split Megatron-style over {members} (tensor parallelism, degree {g.tp_degree})."
    if len(g.replicas) == 1:
        return f"{span}: on {g.replicas[0].device} alone (model parallel; no gradient sync)."
    types = Counter(_kind(prob, r.device) for r in g.replicas)
    kinds = ", ".join(f"{k}×{t}" for t, k in types.items())
    tp = f", each a tensor-parallel set of {g.tp_degree} (blocks split Megatron-style)" if g.tp_degree > 1 else ""
    line = f"{span}: data parallel on {len(g.replicas)} devices ({kinds}){tp}, sync {g.sync}"
    if g.ps_device:
        line += f" via a parameter server on {g.ps_device}"
    idx = [prob.device_names.index(r.device) for r in g.replicas] if prob.n_devices <= 64 else None
    if idx is not None and len(set(np.round(speed[idx], 6))) > 1:
        share: dict[str, tuple[float, float]] = {}
        for r, i in zip(g.replicas, idx):
            share.setdefault(_kind(prob, r.device), (r.share, speed[i]))
        desc = ", ".join(f"{t} {s * 100:.1f}%" for t, (s, _) in share.items())
        by_speed = [s for s, _ in sorted(share.values(), key=lambda sv: sv[1])]
        if len({round(s, 3) for s in by_speed}) == 1:
            line += f"; equal shares ({desc} each) although the devices' speeds differ"
        elif by_speed == sorted(by_speed):
            line += f"; per-replica shares {desc}: the faster a device, the more samples it takes"
        else:
            line += f"; per-replica shares {desc}"
    if g.shard_stage:
        line += _shard_note(prob, plan, a, b)
    return line + "."


_SHARDED_STATE = {
    1: "optimizer state",
    2: "optimizer state and gradients",
    3: "parameters, gradients and optimizer state",
}


def _shard_note(prob: Problem, plan: Plan, a: int, b: int) -> str:
    """Why the segment is sharded: what each replica holds of its state, against whole."""
    g = plan.groups[a]
    idx = tuple(prob.device_names.index(r.device) for r in g.replicas)
    p = Placement(idx, tuple(r.share for r in g.replicas), SyncMethod.RING, None, g.recompute, g.shard_stage, g.shards)
    held = np.sum([replica_state_bytes(prob, x, p) for x in range(a, b)], axis=0)
    whole = sum(prob.persistent_bytes[x, prob.dev_class[list(idx)]] for x in range(a, b))
    pieces = ", ".join(f"{r.device} {(r.shard or 0.0) * 100:.0f}%" for r in g.replicas[:6]) + (
        " …" if len(g.replicas) > 6 else ""
    )
    tight = int(np.argmax(whole / prob.memory_bytes[list(idx)]))
    return (
        f"; ZeRO-{g.shard_stage} shards its {_SHARDED_STATE[g.shard_stage]} across them (pieces {pieces}): "
        f"{g.replicas[tight].device} holds {human_bytes(held[tight])} of it instead of {human_bytes(whole[tight])} "
        f"whole ({human_bytes(prob.cluster.memory_bytes(g.replicas[tight].device))} of memory)"
    )


def accumulation_note(plan: Plan) -> str:
    """Which replicas run their share in sequential pieces (ir/accumulation.py), and the
    samples of a piece; '' when none does."""
    g = plan.groups[0]
    counted = [(r, n) for r, n in zip(g.replicas, plan.replica_samples(g, 0)) if r.accumulate > 1]
    if not counted:
        return ""
    each = ", ".join(f"{r.device} {n} samples in {r.accumulate} pieces" for r, n in counted[:6])
    more = " …" if len(counted) > 6 else ""
    return (
        f"gradient accumulation per replica: {each}{more} (of each micro-batch): each piece runs forward and back "
        f"before the next, adding into the gradients, so its activations are a piece's, not its share's."
    )


def bucket_note(plan: Plan) -> str:
    """The gradient bucket size, where the search chose another than DDP's default (a user who
    syncs with their own DDP sets bucket_cap_mb to it)."""
    syncs = any(len(g.replicas) > 1 and g.sync != SyncMethod.NONE for g in plan.groups)
    if not syncs or plan.bucket_bytes == DEFAULT_BUCKET_BYTES:
        return ""
    smaller = plan.bucket_bytes < DEFAULT_BUCKET_BYTES
    why = (
        "the sync of the last layers' gradients starts earlier in the backward and less of it is left after"
        if smaller
        else "fewer collectives, each paying its latency once"
    )
    return (
        f"gradients sync in buckets of up to {human_bytes(plan.bucket_bytes)} (DDP's default is "
        f"{human_bytes(DEFAULT_BUCKET_BYTES)}): {why}."
    )


def bound_note(bound: Bound, iteration_time_s: float) -> str:
    out = (
        f"within {bound.within(iteration_time_s) * 100:.1f} % of a lower bound, {human_time(bound.iteration_time_s)}, "
        f"that no plan beats ({bound.to_dict()['what']})."
    )
    if (floor := bound.floor_s) is not None:
        gap = iteration_time_s / floor - 1.0
        where = f"{gap * 100:.1f} % above it" if gap >= 0 else f"{-gap * 100:.1f} % below it: it beats data parallelism"
        out += (
            f" No plain data-parallel plan beats {human_time(floor)} (each device the whole model on whole samples, "
            f"then its whole optimizer step, communication free); this plan is {where}."
        )
    return out


def notes(
    prob: Problem,
    winner: Candidate,
    candidates: Sequence[Candidate],
    bound: Bound | None = None,
    choice: Sequence[str] = (),
) -> list[str]:
    """The plan's explanation. Every claim is computed: times and memory from the candidates'
    scores, busy fractions and pipeline fill from a simulation of the winner; `choice`: how the
    objective and the tolerance chose it (search/objective.py), right after the first line."""
    plan = winner.plan
    sim = _simulated(prob, plan) if winner.scored_by == "simulator" else None
    out = [
        f"chose {winner.strategy!r}: {human_time(winner.iteration_time_s)} per iteration "
        f"({'simulated' if winner.scored_by == 'simulator' else 'estimated'}), using "
        f"{len(plan.devices())} of {prob.n_devices} devices."
    ]
    out += list(choice)
    if bound is not None and plan.tensor_parallel and not bound.tensor_parallel:
        out.append(
            f"the lower bound, {human_time(bound.iteration_time_s)}, holds for plans without tensor parallelism "
            f"(the problem did not allow it), so it bounds this plan's alternatives, not this plan."
        )
    elif bound is not None:
        out.append(bound_note(bound, winner.iteration_time_s))
    ref = next((c for c in candidates if c.strategy == "even-dp-allreduce"), None)
    if ref is not None and ref.strategy != winner.strategy:
        if ref.feasible:
            out.append(
                f"{ref.iteration_time_s / winner.iteration_time_s:.2f}× faster than even data "
                f"parallelism with ring all-reduce ({human_time(ref.iteration_time_s)})."
            )
        else:
            worst = max(
                ref.peak_memory_bytes.items(), key=lambda kv: kv[1] / prob.cluster.memory_bytes(kv[0]), default=None
            )
            if worst is not None:
                out.append(
                    f"even data parallelism does not fit: it needs {human_bytes(worst[1])} on "
                    f"{worst[0]}, which has {human_bytes(prob.cluster.memory_bytes(worst[0]))}."
                )
    beaten = [
        f"{c.strategy} {human_time(c.iteration_time_s) if c.feasible else 'infeasible (memory)'}"
        for c in candidates
        if c.strategy != winner.strategy
    ]
    if beaten:
        out.append("compared: " + "; ".join(beaten) + ".")
    speed = 1.0 / prob.device_time_per_sample_s
    segments = _segments(plan)
    out += [_segment_note(prob, plan, a, b, speed) for a, b in segments[:8]]
    if len(segments) > 8:
        out.append(f"… {len(segments) - 8} more segments of groups.")
    if plan.num_microbatches > 1:
        out.append(_microbatch_note(plan, segments, sim))
    if sim is not None and (busy := _busy_note(plan, sim)):
        out.append(busy)
    if not any(g.shard_stage for g in plan.groups):
        out += _no_shard_note(winner, candidates)
    if note := accumulation_note(plan):
        out.append(note)
    if note := bucket_note(plan):
        out.append(note)
    if any(g.recompute for g in plan.groups):
        k = sum(g.recompute for g in plan.groups)
        out.append(f"{k} group(s) recompute activations in backward: less activation memory for a second forward pass.")
    tight = sorted(
        ((b / prob.cluster.memory_bytes(d), d) for d, b in plan.predicted_peak_memory_bytes.items()), reverse=True
    )[:1]
    for frac, d in tight:
        out.append(f"tightest memory: {d} at {frac * 100:.0f}% of {human_bytes(prob.cluster.memory_bytes(d))}.")
    return out


def _no_shard_note(winner: Candidate, candidates: Sequence[Candidate]) -> list[str]:
    """Why the winner shards nothing: the sharded baselines' times against its own."""
    sharded = [c for c in candidates if c.strategy in ("fsdp-even", "zero-uneven")]
    if not sharded:
        return []
    parts = [
        f"{c.strategy} {c.iteration_time_s / winner.iteration_time_s:.2f}× its time"
        if c.feasible
        else f"{c.strategy} does not fit"
        for c in sharded
    ]
    return [
        "no state is sharded: the plan fits without it, and sharding would add gathers and "
        "reduce-scatters of the state to every step (" + "; ".join(parts) + ")."
    ]


def infeasible_message(prob: Problem, candidates: Sequence[Candidate]) -> str:
    """Name the smallest per-device memory any plan we found would need."""
    best_need, best_dev, best_name = None, None, None
    for c in candidates:
        if not c.peak_memory_bytes:
            continue
        dev, need = max(c.peak_memory_bytes.items(), key=lambda kv: kv[1])
        if best_need is None or need < best_need:
            best_need, best_dev, best_name = need, dev, c.strategy
    largest = max(prob.cluster.memory_bytes(d) for d in prob.device_names)
    total_state = float(prob.persistent_bytes[:, prob.dev_class[prob.speed_order[0]]].sum())
    msg = (
        f"model {prob.graph.model!r} at batch {prob.batch_size} fits nowhere on cluster "
        f"{prob.cluster.name!r}: no strategy tried keeps every device within its memory. "
    )
    if best_need is not None:
        msg += (
            f"The smallest need found is {human_bytes(best_need)} on one device ({best_dev}, "
            f"strategy {best_name}); the largest device here has {human_bytes(largest)}. "
        )
    msg += (
        f"Parameters, gradients and optimizer state alone take {human_bytes(total_state)}. "
        f"Use devices with more memory, more devices, a smaller --batch-size, "
        f"--optimizer sgd instead of adamw, or amp-bf16 precision."
    )
    return msg
