"""The least iteration time of any plain data-parallel plan: a second yardstick beside the
lower bound, for the plan family most users compare against.

The lower bound (bound.py) holds for every plan, so it must allow what no real plan reaches
(continuous samples, pipelines without a bubble); on small clusters of small batches that
leaves the best plans 10–30 % above it even where they are as good as data parallelism can be
(benchmarks/bound_tightness.py). This floor is exact about the one family: in plain data
parallelism every used device computes the whole model on a whole number of samples (the
cost model's time at that size, not a hull below it) and then steps its whole optimizer (no
sharded state); communication is left out. So no plain data-parallel plan — any shares,
micro-batches or gradient accumulation (pieces never run faster than their sum: the cost
model's time per sample never rises with the size) — finishes sooner. A plan near it is near
the best data parallelism can do; a plan below it beats data parallelism.
"""

from __future__ import annotations

import time

import numpy as np

from heterog.search.problem import Problem

REL_TOL = 1e-3


class _Late(Exception):
    """The deadline passed while the cost model was asked for a size."""


def plain_data_parallel_s(prob: Problem, deadline_s: float = float("inf")) -> float | None:
    """The least T at which the devices, each computing at most the whole samples the whole
    model and its optimizer step fit in T, hold the batch (bisection to REL_TOL: the largest T
    found where they do not, so no plain data-parallel plan is faster); None when deadline_s
    (a perf_counter time) passes first — checked before every size the cost model is asked
    for (at a thousand devices one size of the whole model costs milliseconds where the bound
    has not asked for it, microseconds where it has)."""
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    groups = [tuple(names) for names in prob.groups]
    per_class: list[tuple[int, dict[int, float], str, float]] = []
    # each class's device as the bound named it (its first tier's), so the sizes it asked are cached
    rep_of = list(prob.class_rep)
    for devs in reversed(prob.tiers):  # the first tier of a class names it last
        rep_of[int(prob.dev_class[devs[0]])] = prob.device_names[devs[0]]
    for c, rep in enumerate(rep_of):
        opt = sum(table.optimizer_s(names, rep) for names in groups)
        per_class.append((int(np.sum(prob.dev_class == c)), {}, rep, opt))

    def step_s(times: dict[int, float], rep: str, opt: float, b: int) -> float:
        if b not in times:
            if time.perf_counter() >= deadline_s:
                raise _Late
            times[b] = sum(sum(table.times_s(names, rep, b)) for names in groups) + opt
        return times[b]

    def most(times: dict[int, float], rep: str, opt: float, t: float) -> int:
        """The most whole samples one device of the class computes and steps within t (the
        cost model's time never falls as the samples grow: a search doubling from one sample,
        then halving — a device's share is small on a large cluster, and the bound has asked
        the cost model at every size up to 16 already)."""
        lo, hi = 0, 1
        while hi < prob.batch_size and step_s(times, rep, opt, hi) <= t:
            lo, hi = hi, min(2 * hi, prob.batch_size)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if step_s(times, rep, opt, mid) <= t else (lo, mid - 1)
        return lo

    def holds(t: float) -> bool:
        return sum(n * most(times, rep, opt, t) for n, times, rep, opt in per_class) >= prob.batch_size

    try:
        # every device at an even share holds the batch: the bisection starts there, so it asks
        # the cost model at a share's few sizes, not at the whole batch's
        even = -(-prob.batch_size // int(sum(n for n, *_ in per_class)))
        hi = max(step_s(times, rep, opt, even) for _, times, rep, opt in per_class)
        lo = 0.0
        while hi - lo > REL_TOL * hi:
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    except _Late:
        return None
    return lo
