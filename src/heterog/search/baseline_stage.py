"""The planner's baselines stage and the search lane's starts (planner.py): the baselines are
built and simulated in one stated order while their stage's time lasts, and the search lane
starts from them — a larger budget scores a longer prefix of the same list, so it never gives a
worse plan with the same seed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from heterog.ir.kinds import PipelineSchedule
from heterog.search.baselines import BASELINE_BUILDERS, node_dp_starts, pipeline, tier_dp_starts
from heterog.search.lanes import Candidate, finalize
from heterog.search.problem import Problem, Strategy

# the order the baselines are built and simulated in, and the search lane's starts among them:
# data parallelism first (quick, and often the best of them), the pipeline next (the best for
# the language models at a thousand devices), then the rest. Each with its cost (building and
# simulating it) relative to data parallelism's, as measured at 1024 devices for resnet50 and
# gpt2-xl: a baseline is scored only while it would end within its stage (score_baselines)
BASELINE_ORDER = {
    "proportional-dp": 1.0,
    "even-dp-allreduce": 1.0,
    "pipeline": 16.0,  # the stage split
    "model-parallel": 1.0,
    "even-dp-ps": 5.0,
    "fsdp-even": 9.0,  # the memory fits of the sharded state
    "zero-uneven": 20.0,
    "single-device": 7.0,  # one device's timeline of every task
}
assert sorted(BASELINE_ORDER) == sorted(BASELINE_BUILDERS), "every baseline has its place in BASELINE_ORDER"
BASELINE_SHARE = 0.5  # of the time left after grouping: the baselines past the first
# the costs above are measured at 1024 devices; at 4096 zero-uneven takes twice its share (8.2 s
# against 4.1): a lane builds a skipped baseline only where twice its cost fits
LANE_MARGIN = 2.0


def search_starts(
    baselines: dict[str, Strategy] | None,
    warm: Sequence[Strategy] = (),
    extra: Sequence[Strategy] = (),
    unit_s: float = 0.0,
) -> Callable[[Problem, float], Iterator[Strategy]]:
    """The search lane's starts: a warm start's strategies first (search/warm.py: an earlier
    plan on this cluster's devices), the baselines (None: a second chain beside the planner's own,
    which has scored them, starts from proportional data parallelism instead), data
    parallelism over the fastest tiers and inside each kind of node, and a 1F1B pipeline (far
    less activation memory per stage, the way into models that no baseline fits) — made one
    by one inside the lane; a baseline the stage skipped and the pipeline (seconds at a
    thousand devices) only where they would be built and scored by the lane's deadline at
    LANE_MARGIN × unit_s per unit of their cost in BASELINE_ORDER (the baselines stage's
    figure)."""

    def fits(cost: float, deadline_s: float) -> bool:
        return time.perf_counter() + LANE_MARGIN * unit_s * cost < deadline_s

    def make(prob: Problem, deadline_s: float) -> Iterator[Strategy]:
        yield from warm
        if baselines is None:
            yield BASELINE_BUILDERS["proportional-dp"](prob)
        else:  # in one order whatever the budget, those the baselines' stage had no time for built here
            for name, cost in BASELINE_ORDER.items():
                if name in baselines:
                    yield baselines[name]
                elif fits(cost, deadline_s):
                    yield BASELINE_BUILDERS[name](prob)
        yield from extra  # the megatron-3d grid's plan
        yield from tier_dp_starts(prob)
        yield from node_dp_starts(prob)
        if fits(BASELINE_ORDER["pipeline"], deadline_s):
            yield pipeline(prob, PipelineSchedule.ONE_F_ONE_B)

    return make


@dataclass(frozen=True, kw_only=True)
class Baselines:
    strategies: dict[str, Strategy]
    candidates: dict[str, Candidate]
    known: dict[tuple, tuple[float, Candidate]]  # what a chain starting from them need not score
    per_call_s: float  # one simulation, the median
    unit_s: float  # building and simulating one unit of cost in BASELINE_ORDER
    skipped: tuple[str, ...]  # not built before the stage's end


def score_baselines(prob: Problem, until_s: float) -> Baselines:
    """The baselines in BASELINE_ORDER, each built and simulated while it would end by until_s
    at the time per unit of cost of those before it, and until one fits in memory whatever the
    time (a model too large for data parallelism still gets a plan): a larger budget scores a
    longer prefix of the same list."""
    strategies: dict[str, Strategy] = {}
    candidates: dict[str, Candidate] = {}
    scores: dict[tuple, float] = {}
    simulations_s: list[float] = []
    units, begin = 0.0, time.perf_counter()
    for name, cost in BASELINE_ORDER.items():
        now = time.perf_counter()
        fits = any(c.feasible for c in candidates.values())
        if fits and now + (now - begin) / units * cost > until_s:
            break
        units += cost
        strategies[name] = BASELINE_BUILDERS[name](prob)
        t0 = time.perf_counter()
        candidates[name] = finalize(prob, strategies[name], name, scores)
        simulations_s.append(time.perf_counter() - t0)
    known = {s.key(): (scores[s.key()], candidates[n]) for n, s in strategies.items() if s.key() in scores}
    return Baselines(
        strategies=strategies,
        candidates=candidates,
        known=known,
        per_call_s=statistics.median(simulations_s),  # the first also fills the simulator's caches
        unit_s=(time.perf_counter() - begin) / units,
        skipped=tuple(n for n in BASELINE_ORDER if n not in strategies),
    )
