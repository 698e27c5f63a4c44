"""The strategies heterog compares itself against, each built as a Strategy (then a Plan).

- single-device: the whole model on the fastest device that holds it;
- even-dp-allreduce: every device a replica, equal shares, ring all-reduce (Horovod / DDP);
- even-dp-ps: equal shares, gradients through parameter servers sharded over the devices
  (group g's server is device g mod n, as TensorFlow's PS strategy spreads variables);
- proportional-dp: shares proportional to each device's throughput, ring all-reduce;
- model-parallel: contiguous stages, one device each, balanced by the devices' speeds;
- pipeline: contiguous stages, each data-parallel over a block of devices, an uneven split of
  the layers proportional to each block's speed, and GPipe micro-batches;
- fsdp-even: FSDP / ZeRO-3 as torch's fully_shard runs it — every device a replica, equal
  shares, the state sharded evenly (Rajbhandari et al. 2020; Zhao et al., PyTorch FSDP 2023);
- zero-uneven: Cephalo's rule (ICS'25) — batch shares proportional to speed, ZeRO-3 state
  shares proportional to the memory each device has free; or ZeRO-2 with gradient
  accumulation per replica, each count the smallest that fits its activations.
Baselines ignore memory, as the systems they stand for do (but for the sharded two, which
exist to fit: like their recipes they turn on activation checkpointing and gradient
accumulation when the model does not fit otherwise); the planner reports them infeasible
when they overflow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

import numpy as np

from heterog.ir.kinds import PipelineSchedule, ShardStage, SyncMethod
from heterog.search.estimate import estimate
from heterog.search.problem import Placement, Problem, Strategy
from heterog.search.sharding import fitting_counts, free_memory_fractions, sharded
from heterog.search.shares import balanced_shares

BASELINES = (
    "single-device",
    "even-dp-allreduce",
    "even-dp-ps",
    "proportional-dp",
    "model-parallel",
    "pipeline",
    "fsdp-even",
    "zero-uneven",
)
MICROBATCH_CHOICES = (1, 2, 4, 8, 16, 32)


def _uniform(prob: Problem, placement: Placement, microbatches: int = 1) -> Strategy:
    return Strategy(tuple(placement for _ in range(prob.n_groups)), microbatches)


def _dp_devices(prob: Problem) -> list[int]:
    """Data parallelism cannot use more replicas than samples: keep the fastest ones."""
    return sorted(prob.speed_order[: min(prob.n_devices, prob.batch_size)])


def single_device(prob: Problem) -> Strategy:
    """The fastest device that holds the model (one try per device class: a class's devices
    fit alike), else the fastest."""
    best, tried = None, set()
    for d in prob.speed_order:
        if prob.dev_class[d] in tried:
            continue
        tried.add(prob.dev_class[d])
        s = _uniform(prob, Placement((d,), (1.0,)))
        if best is None:
            best = s
        if estimate(prob, s).feasible:
            return s
    assert best is not None  # a problem has at least one device
    return best


def even_dp(prob: Problem, sync: SyncMethod = SyncMethod.RING) -> Strategy:
    devs = tuple(_dp_devices(prob))
    n = len(devs)
    if n == 1:
        return single_device(prob)
    share = tuple([1.0 / n] * n)
    if sync == SyncMethod.PS:
        return Strategy(tuple(Placement(devs, share, SyncMethod.PS, devs[g % n]) for g in range(prob.n_groups)))
    return _uniform(prob, Placement(devs, share, sync))


def proportional_dp(prob: Problem) -> Strategy:
    devs = _dp_devices(prob)
    if len(devs) == 1:
        return single_device(prob)
    speed = 1.0 / prob.device_time_per_sample_s[devs]
    shares = speed / speed.sum()
    return _uniform(prob, Placement(tuple(devs), tuple(float(x) for x in shares), SyncMethod.RING))


def node_dp_starts(prob: Problem) -> list[Strategy]:
    """Speed-proportional data parallelism over the devices of each node that has several:
    starts for the search, not baselines. Leaving out a node behind a slow link (or a small
    device) is then a start, not a chain of moves that annealing must keep
    (docs/scenarios.md, "What the planner needs for the LM"). One node of each kind: nodes whose
    devices are of the same tiers (Problem.tiers) make the same start."""
    out, kinds = [], set()
    dp = _dp_devices(prob)
    for node in sorted(set(prob.node_idx.tolist())):
        devs = [d for d in dp if prob.node_idx[d] == node]
        kind = tuple(sorted(prob.tier_of[d] for d in devs))
        if 1 < len(devs) < prob.n_devices and kind not in kinds:
            kinds.add(kind)
            speed = 1.0 / prob.device_time_per_sample_s[devs]
            shares = tuple(float(x) for x in speed / speed.sum())
            out.append(_uniform(prob, Placement(tuple(devs), shares, SyncMethod.RING)))
    return out


def tier_dp_starts(prob: Problem) -> Iterator[Strategy]:
    """Data parallelism over the fastest k tiers (Problem.tiers), k = 1, 2, …, each with the
    all-reduce the cost model times fastest for the model's gradients: starts for the search.
    At a thousand devices the best plan often leaves the slow tiers out (their devices slow
    every all-reduce more than their samples help), which these reach in one step."""
    speed = prob.device_time_per_sample_s
    order = sorted(range(len(prob.tiers)), key=lambda t: (speed[prob.tiers[t][0]], t))
    for k in range(1, len(order) + 1):
        devs = sorted(d for t in order[:k] for d in prob.tiers[t])[: prob.batch_size]
        s = dp_over(prob, devs)
        if s is not None and len(s.placements[0].devices) > 1:
            yield s


def dp_over(prob: Problem, devs: list[int]) -> Strategy | None:
    """Data parallelism over `devs` with the batch-share LP's shares and the all-reduce the
    cost model times fastest for the model's gradients (one device: that device alone); None
    when the LP gives samples to no device."""
    d, sh = balanced_shares(prob, range(prob.n_groups), devs)
    if not d:
        return None
    if len(d) == 1:
        return _uniform(prob, Placement(d, (1.0,)))
    grad = float(prob.grad_bytes.sum())
    p = min(
        (Placement(d, sh, sync) for sync in (SyncMethod.RING, SyncMethod.TREE, SyncMethod.HIERARCHICAL)),
        key=lambda q: prob.sync_time_bytes_s(q, grad),
    )
    return _uniform(prob, p)


def device_blocks(prob: Problem, k: int) -> list[list[int]]:
    """k blocks of devices, contiguous in node order (a stage stays inside nodes when it can)."""
    order = sorted(range(prob.n_devices), key=lambda i: (prob.node_of_device[i], i))
    n = len(order)
    return [order[j * n // k : (j + 1) * n // k] for j in range(k)]


def partition_stages(prob: Problem, blocks: list[list[int]], act_fraction: float = 1.0) -> list[tuple[int, int]] | None:
    """Contiguous group ranges, one per block in order, minimising the slowest stage.

    Stage time = the groups' per-sample time on the block's reference speed × batch / the
    block's aggregate speed (linear partition DP, O(k·G²)), inflated when the stage's
    persistent state plus act_fraction of its activations overflow a device of the block.
    None if there are more blocks than groups.
    """
    G, k = prob.n_groups, len(blocks)
    if k > G:
        return None
    per_class = prob.fwd[:, :, 1] + prob.bwd[:, :, 1] + (prob.fwd[:, :, 0] + prob.bwd[:, :, 0]) / prob.batch_size
    pre_t = np.vstack([np.zeros(per_class.shape[1]), np.cumsum(per_class, axis=0)])
    pre_mem = np.vstack([np.zeros(per_class.shape[1]), np.cumsum(prob.persistent_bytes, axis=0)])
    pre_act = np.concatenate([[0.0], np.cumsum(prob.act_per_sample[:, 0])])
    B = prob.batch_size

    def stage_cost(j: int, a: int, b: int) -> float:
        devs = np.asarray(blocks[j])
        cls = prob.dev_class[devs]
        t = pre_t[b, cls] - pre_t[a, cls]  # per-sample time of groups a..b-1 per device
        rate = (1.0 / np.maximum(t, 1e-30)).sum()  # samples per second of the block
        share = (1.0 / np.maximum(t, 1e-30)) / rate
        mem = pre_mem[b, cls] - pre_mem[a, cls] + (pre_act[b] - pre_act[a]) * share * B * act_fraction
        over = float(np.max((mem - prob.memory_bytes[devs]) / prob.memory_bytes[devs]))
        # overflow is penalised, not excluded, so a memory-bound model still gets its
        # least-overflowing split (which 1F1B or recomputation may then make fit)
        return B / rate * (1.0 + 10.0 * max(0.0, over))

    inf = float("inf")
    best = np.full((k + 1, G + 1), inf)
    arg = np.zeros((k + 1, G + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, k + 1):
        for b in range(j, G - (k - j) + 1):
            for a in range(j - 1, b):
                if best[j - 1, a] == inf:
                    continue
                v = max(best[j - 1, a], stage_cost(j - 1, a, b))
                if v < best[j, b]:
                    best[j, b], arg[j, b] = v, a
    if best[k, G] == inf:
        return None
    ranges, b = [], G
    for j in range(k, 0, -1):
        a = int(arg[j, b])
        ranges.append((a, b))
        b = a
    return ranges[::-1]


def _staged(prob: Problem, blocks: list[list[int]], ranges: list[tuple[int, int]], microbatches: int) -> Strategy:
    placements: list[Placement] = [None] * prob.n_groups  # type: ignore[list-item]
    for devs, (a, b) in zip(blocks, ranges):
        groups = list(range(a, b))
        d, sh = balanced_shares(prob, groups, devs, microbatches=microbatches)
        p = Placement(d, sh, SyncMethod.RING if len(d) > 1 else SyncMethod.NONE)
        for g in groups:
            placements[g] = p
    return Strategy(tuple(placements), microbatches)


def _best(prob: Problem, candidates: list[Strategy]) -> Strategy:
    return min(candidates, key=lambda s: estimate(prob, s).score)


def model_parallel(prob: Problem) -> Strategy:
    """One stage per device over the fastest min(n, G) devices (in node order), no micro-batches."""
    k = min(prob.n_devices, prob.n_groups)
    fastest = sorted(prob.speed_order[:k], key=lambda i: (prob.node_of_device[i], i))
    blocks = [[d] for d in fastest]
    while k > 1:
        ranges = partition_stages(prob, blocks)
        if ranges is not None:
            return _staged(prob, blocks, ranges, 1)
        k -= 1  # cannot happen with fewer groups than devices unless memory is short; keep trying
        blocks = [[d] for d in fastest[:k]]
    return single_device(prob)


def pipeline(prob: Problem, schedule: PipelineSchedule = PipelineSchedule.GPIPE) -> Strategy:
    """Stages over blocks of devices (2, 4, 8, … stages), uneven layer split, best micro-batch
    count. With schedule='1f1b' a stage holds only its in-flight micro-batches' activations."""
    candidates: list[Strategy] = []
    k = 2
    while k <= min(prob.n_devices, prob.n_groups):
        blocks = device_blocks(prob, k)
        splits: dict[float, list[tuple[int, int]] | None] = {}
        for m in MICROBATCH_CHOICES:
            if m > 1 and prob.batch_size % m == 0 and prob.batch_size // m >= max(len(b) for b in blocks):
                frac = 1.0 if schedule == PipelineSchedule.GPIPE else min(m, k) / m
                if frac not in splits:
                    splits[frac] = partition_stages(prob, blocks, frac)
                ranges = splits[frac]
                if ranges is not None:
                    st = _staged(prob, blocks, ranges, m)
                    candidates.append(Strategy(st.placements, m, schedule))
        k *= 2
    return _best(prob, candidates) if candidates else model_parallel(prob)


def _fitted(prob: Problem, *makes: Callable[[bool, int], Strategy], replicas: int = 1) -> Strategy:
    """The fastest of make(recompute, micro-batches) that fits (estimate), over each of
    `makes`, activation checkpointing on and off and the micro-batch counts that leave every
    one of `replicas` a sample; else the one that overflows least."""
    options = [
        make(recompute, m)
        for make in makes
        for recompute in (False, True)
        for m in MICROBATCH_CHOICES
        if prob.batch_size % m == 0 and prob.batch_size // m >= replicas
    ]
    scored = [(estimate(prob, prob.finalize(s)), s) for s in options]
    fits = [(e.iteration_time_s, i) for i, (e, _) in enumerate(scored) if e.feasible]
    if fits:
        return scored[min(fits)[1]][1]
    return min(scored, key=lambda es: es[0].overflow)[1]


def fsdp_even(prob: Problem) -> Strategy:
    """ZeRO-3 with even shards and an even batch over the data-parallel devices."""
    devs = tuple(_dp_devices(prob))
    if len(devs) == 1:
        return single_device(prob)
    even = tuple([1.0 / len(devs)] * len(devs))

    def make(recompute: bool, m: int) -> Strategy:
        return _uniform(prob, Placement(devs, even, SyncMethod.RING, None, recompute, 3, even), m)

    return _fitted(prob, make, replicas=len(devs))


def zero_uneven(prob: Problem) -> Strategy:
    """Cephalo's rule: batch ∝ speed, state ∝ free memory (sharding.free_memory_fractions):
    ZeRO-3, or ZeRO-2 with each replica's accumulation count set so its activations fit
    (sharding.fitting_counts; counts are defined up to stage 2, ir/accumulation.py)."""
    devs = _dp_devices(prob)
    if len(devs) == 1:
        return single_device(prob)
    speed = 1.0 / prob.device_time_per_sample_s[devs]
    shares = tuple(float(x) for x in speed / speed.sum())

    def make(stage: int, recompute: bool, m: int) -> Strategy:
        # the replicas left with samples (integer_placement) share the state
        p = prob.integer_placement(
            Placement(tuple(devs), shares, SyncMethod.RING, None, recompute), prob.batch_size // m
        )
        q = sharded(p, stage, free_memory_fractions(prob, range(prob.n_groups), p, stage, m))
        if stage < ShardStage.PARAMETERS:
            q = replace(q, accumulate=fitting_counts(prob, q, m))
        return _uniform(prob, q, m)

    return _fitted(prob, partial(make, ShardStage.PARAMETERS), partial(make, ShardStage.GRADIENTS))


BASELINE_BUILDERS: dict[str, Callable[[Problem], Strategy]] = {
    "single-device": single_device,
    "even-dp-allreduce": lambda p: even_dp(p, SyncMethod.RING),
    "even-dp-ps": lambda p: even_dp(p, SyncMethod.PS),
    "proportional-dp": proportional_dp,
    "model-parallel": model_parallel,
    "pipeline": pipeline,
    "fsdp-even": fsdp_even,
    "zero-uneven": zero_uneven,
}
