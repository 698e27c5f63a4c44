"""The planner: from a model's graph, a cluster and costs to the best Plan, the table of every
candidate it compared, and a lower bound beside them (the capture and the costs before it:
heterog/plan_module.py).

Order, every stage within one deadline (the budget): group the graph → baselines, each
scored by the simulator, in BASELINE_ORDER while BASELINE_SHARE of the time lasts → the lower
bound (bound.py; its bisection stops after BOUND_SHARE of what is left) → data parallelism on fewer devices
(objective.py subsets, in SUBSET_SHARE of the lanes' time) → search lanes (lanes.py): an annealing
chain from the baselines ('search') and one from the GNN policy's proposals ('gnn',
'gnn+search'), side by side in two processes where the machine has two cores, one after the
other (the GNN lane taking GNN_SHARE of the time) where it has one → the best feasible
candidate by the objective (search/objective.py), explained. The fastest is the minimum over
all feasible candidates, so it is never worse than a baseline as the simulator scores them;
and since a lane's candidate is the best of a prefix of its seed's moves, a larger budget
never gives a worse one. The objective chooses by time or cost, within its tolerance.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from heterog._signals import signals_deferred
from heterog.cost.model import CostModel
from heterog.cost.precision import precision_advice
from heterog.errors import InfeasibleError, PlanError, did_you_mean
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_to_dict
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import ModelSpec, Plan
from heterog.lower.tensor_parallel import TensorParallelSupport
from heterog.search import explain
from heterog.search.baseline_stage import BASELINE_SHARE, score_baselines, search_starts
from heterog.search.baselines import BASELINE_BUILDERS, BASELINES
from heterog.search.bound import Bound, lower_bound
from heterog.search.constraints import DEFAULT_CACHE, ConstraintCache, ModelCuts, violations
from heterog.search.dp_floor import plain_data_parallel_s
from heterog.search.grouping import make_groups
from heterog.search.lanes import (
    Best,
    Candidate,
    Forked,
    Lane,
    LaneStats,
    _simulator,
    as_estimate,
    can_fork,
    finalize,
    run_lane,
    simulator_scorer,
    usable_cores,
)
from heterog.search.objective import SUBSET_SHARE, Goal, check_priced, choose, subset_candidates
from heterog.search.problem import Problem, Strategy
from heterog.search.tp_moves import GRID_NAME, GridBaseline, megatron_baseline, whole_regions
from heterog.search.warm import warm_start

__all__ = ["CANDIDATES", "Candidate", "PlanResult", "load_code", "plan_graph", "simulator_scorer"]

CANDIDATES = (*BASELINES, GRID_NAME, "search", "gnn", "gnn+search")
DEFAULT_BUDGET_S = 10.0
GNN_SHARE = 0.4  # on one core: the GNN lane's part of the search time (policy, proposals, chain)
GRID_SHARE = 0.2  # the megatron-3d grid's part of the time left after the bound (tp_moves.py)
# kept back from the lanes: the winner's explanation simulates it once; plain data parallelism's
# floor (dp_floor.py) has the other, so the lanes keep their time
RESERVE_SIMULATIONS = 2
FLOOR_MIN_S = 0.05
REQUIRED_STAGES = ("graph", "cluster_and_costs", "cut_analysis", "grouping", "baselines", "bound")
BOUND_SHARE = 0.25  # of the time left after the baselines: the bound's bisection (a looser bound after)


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Plan
    candidates: tuple[Candidate, ...]
    search_time_s: float  # plan_graph from start to end
    other_time_s: dict[str, float] = field(default_factory=dict)  # what else planning took (graph, costs)
    time_s: dict[str, float] = field(default_factory=dict)  # where plan_graph's time went, by stage
    budget_s: float | None = None
    budget_split: dict[str, Any] = field(default_factory=dict)  # decided before the lanes start
    bound: Bound | None = None
    lanes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per lane: moves, new bests, cut by

    def plan_of(self, strategy: str) -> Plan:
        """The plan of the candidate named `strategy` (a baseline's or heterog's)."""
        for c in self.candidates:
            if c.strategy == strategy:
                return c.plan
        names = [c.strategy for c in self.candidates]
        raise PlanError(
            f"no candidate named {strategy!r}.{did_you_mean(strategy, names)} The planner compared {', '.join(names)}."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "search_time_s": self.search_time_s,
            "other_time_s": dict(self.other_time_s),
            "time_s": dict(self.time_s),
            "budget_s": self.budget_s,
            "budget_split": dict(self.budget_split),
            "bound": self.bound.to_dict() if self.bound is not None else None,
            "lanes": dict(self.lanes),
        }


class _Stages:
    """Seconds per stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.time_s: dict[str, float] = {}
        self._t = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.time_s[stage] = self.time_s.get(stage, 0.0) + now - self._t
        self._t = now


def _has_policy(policy: Any) -> bool:
    """Whether the GNN lane runs: a policy given, or the shipped file present (checked without
    importing torch, which the lane does itself)."""
    if policy is False:
        return False
    return policy is not None or resources.files("heterog.search.gnn").joinpath("policy.pt").is_file()


def load_code(policy: Any) -> None:
    """What a process loads once, before the budget's clock starts, as the command's other
    imports: the GNN's modules (torch, torch_geometric) and the simulator's compiled code
    (numba loads it on the first call: a tiny plan is simulated). A lane forked afterwards
    has them. Seconds the first time, nothing after."""
    with signals_deferred():  # a stop now is delivered after: see _signals.py
        if _has_policy(policy):
            # torch and torch_geometric take seconds: loaded only when a GNN lane runs
            import heterog.search.gnn.policy  # noqa: F401
        _simulate_once()


@functools.cache
def _simulate_once() -> None:
    # the toy problem's helpers are needed only for this one warm-up call
    from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster

    graph = layered_graph([(0.1, 1, 0.1)] * 4, batch_size=8)
    cluster = toy_cluster([10.0, 10.0])
    costs = TableCostModel(graph=graph, cluster=cluster)
    prob = Problem(
        graph=graph, cluster=cluster, costs=costs, groups=make_groups(graph, cluster, costs, 2), batch_size=8
    )
    finalize(prob, BASELINE_BUILDERS["pipeline"](prob), "warm-up")


def _gnn_starts(policy: Any, finetune_s: float, seed: int, fallback: Callable[[Problem, float], Iterator[Strategy]]):
    """The GNN lane's starts: its policy's proposals (after fine-tuning a copy on this very
    problem for finetune_s, at most half the lane's time)."""

    def make(prob: Problem, deadline_s: float) -> Iterable[Strategy]:
        # torch_geometric takes seconds to import: only in the lane that uses the policy
        from heterog.search.gnn.policy import load_policy

        pol = load_policy(policy)
        if pol is None:
            return fallback(prob, deadline_s)
        tune_s = min(finetune_s, max(0.0, deadline_s - time.perf_counter()) / 2)
        if tune_s > 0:
            # fine-tuning's modules load only when a fine-tune budget is given
            import copy

            from heterog.search.gnn.train import TrainConfig, train

            pol = copy.deepcopy(pol)
            train(pol, [prob], TrainConfig(steps=100_000, seed=seed), budget_s=tune_s)
        return pol.propose(prob, samples=8, seed=seed)

    return make


def _other_lane(policy: Any, seed: int, finetune_s: float, parallel: bool) -> Lane | None:
    """The lane a forked process runs: the GNN's, or on two cores a second search chain."""
    if _has_policy(policy):
        starts = _gnn_starts(policy, finetune_s, seed, search_starts(None))
        return Lane(name="gnn+search", seed=seed + 1, starts=starts, start_name="gnn")
    return Lane(name="search", seed=seed + 1, starts=search_starts(None)) if parallel else None


def _run_lanes(
    prob: Problem, mine: Lane, other: Lane | None, forked: Forked | None, end_s: float, *, emit, say, **kw
) -> tuple[list[LaneStats], dict[str, Any]]:
    """Run the lanes until end_s and state how the time was split, before they start. With
    two cores the other lane has run in its forked process from the start, beside this one;
    with one it runs first and alone for GNN_SHARE of the time. Either way its process is
    ended at its time, keeping every candidate it sent (the GNN lane may still be importing
    torch when a small budget ends)."""
    now = time.perf_counter()
    left = max(0.0, end_s - now)
    show = lambda lo, hi: lambda f: say(mine.name, 0.1 + 0.8 * (lo + (hi - lo) * f))  # noqa: E731
    if other is None:
        stats = run_lane(prob, mine, deadline_s=end_s, emit=emit, progress=show(0, 1), **kw)
        return [stats], {"parallel": False, "lanes_s": {mine.name: left}}
    if forked is not None:
        stats = run_lane(prob, mine, deadline_s=end_s, emit=emit, progress=show(0, 1), **kw)
        lanes_s = {mine.name: left, f"{other.name} (second process)": end_s - forked.since_s}
        return [stats, forked.collect(emit, end_s)], {"parallel": True, "lanes_s": lanes_s}
    mid = now + GNN_SHARE * left
    say(other.name, 0.1)
    child = Forked(prob, other, deadline_s=mid, **kw)
    try:
        first = child.collect(emit, mid + 0.1 * (end_s - mid))
    finally:
        child.stop()
    stats = run_lane(prob, mine, deadline_s=end_s, emit=emit, progress=show(GNN_SHARE, 1), **kw)
    return [first, stats], {"parallel": False, "lanes_s": {other.name: mid - now, mine.name: end_s - mid}}


def plan_graph(
    graph: OpGraph,
    cluster: Cluster,
    costs: CostModel,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    seed: int = 0,
    max_groups: int = 32,
    policy: Any = None,
    model_spec: ModelSpec | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
    max_iters: int | None = None,
    scorer: str = "auto",
    finetune_s: float = 0.0,
    progress: Callable[[str, float], None] | None = None,
    cuts: ModelCuts | None | str = "auto",
    cut_cache: ConstraintCache | None = None,
    deadline_s: float | None = None,
    workers: int | None = None,
    goal: Goal | None = None,
    starts: Sequence[Plan] = (),
    tensor_parallel: str | bool = TensorParallelSupport.ANY,
) -> PlanResult:
    """The best Plan for `graph` on `cluster`, ending about `budget_s` seconds after the call
    (or at `deadline_s`, a time.perf_counter() value, when the caller's clock started earlier).

    policy: None loads the shipped pre-trained GNN, a path loads that file, a policy object is
    used as is, False skips the GNN candidates. max_iters caps each chain's moves and makes the
    run reproducible on any machine (the deadline is then only a safety stop).
    scorer: what the chains' moves are scored by — 'simulator', 'estimate', or 'auto' (the
    simulator when it is installed: with its caches one to five times the estimate's cost per
    neighbour, and the final word anyway).
    finetune_s: seconds of REINFORCE on this very problem before the GNN proposes (a copy of
    the policy is tuned; the file is untouched), taken from the GNN lane's time.
    cuts: what the executor can cut (search/constraints.py); 'auto' exports `model_spec`'s
    model once per `cut_cache` (the module's default cache when None), None ignores them.
    Groups follow them, and a candidate that breaks them is reported infeasible.
    workers: processes for the lanes (default: the usable cores, at most 2).
    goal: the objective, price ceiling and tolerance of the final choice (search/objective.py).
    starts: earlier plans of the model (another cluster's), each restricted to this cluster's
    devices and tried first by the search chains (search/warm.py): a warm-started re-plan.
    tensor_parallel: how far the search may split groups by tensor parallelism (tp_moves.py):
    'any', 'uniform' (one degree for every group) or 'none' (also True / False); where the plan
    is run, what the executor runs (lower/tensor_parallel.py executor_tensor_parallel).
    """
    goal = goal if goal is not None else Goal()
    check_priced(cluster, goal)
    load_code(policy)
    begin = time.perf_counter()
    deadline = deadline_s if deadline_s is not None else begin + budget_s
    stages = _Stages()
    say = progress or (lambda stage, frac: None)
    if cuts == "auto":  # an export, seconds once per model
        cuts = (cut_cache or DEFAULT_CACHE).get(model_spec) if model_spec is not None else None
    stages.done("cut_analysis")
    assert cuts is None or isinstance(cuts, ModelCuts), cuts
    say("grouping", 0.0)
    # the estimate does not price a split: tensor parallelism only where the simulator scores
    may_split = _support(tensor_parallel) if _uses_simulator(scorer) else TensorParallelSupport.NONE
    fields = {"model_spec": model_spec, "precision": precision, "optimizer": optimizer, "cuts": cuts}
    prob = _problem(graph, cluster, costs, max_groups, tensor_parallel=may_split, **fields)
    stages.done("grouping")
    lanes = _LaneOptions(policy=policy, seed=seed, finetune_s=finetune_s, workers=workers, scorer=scorer)
    best, ordered, bound, lane_stats, split = _search(prob, lanes, max_iters, starts, goal, deadline, stages, say)
    return PlanResult(
        best=best,
        candidates=tuple(ordered),
        search_time_s=time.perf_counter() - begin,
        other_time_s={"cut_analysis": stages.time_s["cut_analysis"]},
        time_s=stages.time_s,
        budget_s=budget_s,
        budget_split=split,
        bound=bound,
        lanes=_lane_table(lane_stats),
    )


def _support(tensor_parallel: str | bool) -> TensorParallelSupport:
    """plan_graph's tensor_parallel as a TensorParallelSupport (True: any, False: none)."""
    if isinstance(tensor_parallel, bool):
        return TensorParallelSupport.ANY if tensor_parallel else TensorParallelSupport.NONE
    try:
        return TensorParallelSupport(tensor_parallel)
    except ValueError:
        raise PlanError(
            f"tensor_parallel={tensor_parallel!r}: give one of {', '.join(TensorParallelSupport)} (or True / False)."
        ) from None


def _problem(graph: OpGraph, cluster: Cluster, costs: CostModel, max_groups: int, **kw: Any) -> Problem:
    """The search's problem: the graph grouped (each block's split region in one group where
    the search may split groups by tensor parallelism, tp_moves.py) and its cost tables; `kw`:
    Problem's fields model_spec, precision, optimizer, cuts and tensor_parallel."""
    groups = make_groups(graph, cluster, costs, max_groups, kw["cuts"])
    if kw["tensor_parallel"] != TensorParallelSupport.NONE:
        groups = whole_regions(graph, costs, groups)
    return Problem(graph=graph, cluster=cluster, costs=costs, groups=groups, batch_size=graph.batch_size, **kw)


@dataclass(frozen=True, kw_only=True)
class _LaneOptions:
    """How plan_graph's lanes run (its arguments of the same names)."""

    policy: Any
    seed: int
    finetune_s: float
    workers: int | None
    scorer: str


def _search(
    prob: Problem,
    o: _LaneOptions,
    max_iters: int | None,
    starts: Iterable[Plan],
    goal: Goal,
    deadline: float,
    stages: _Stages,
    say: Callable[[str, float], None],
) -> tuple[Plan, list[Candidate], Bound, list[LaneStats], dict[str, Any]]:
    """Baselines, bound, subsets and the lanes, all before `deadline`; then the choice by
    `goal`: (the chosen plan, every candidate, the bound, the lanes' stats, the time split)."""
    n_workers = min(2, usable_cores()) if o.workers is None else o.workers
    parallel = n_workers >= 2 and can_fork()
    other = _other_lane(o.policy, o.seed, o.finetune_s, parallel)
    warm = [w for p in starts if (w := warm_start(prob, p)) is not None]
    if warm and other is not None and other.start_name is None:  # the second search chain starts warm too
        other = replace(other, starts=search_starts(None, warm))
    kw = {"max_iters": max_iters, "use_simulator": _uses_simulator(o.scorer)}
    forked = None
    try:
        # on two cores the other lane starts now (the GNN's proposals beside the baselines)
        if parallel and other is not None:
            forked = Forked(prob, other, deadline_s=deadline, **kw)
        say("baselines", 0.03)
        base = score_baselines(prob, _share_of(deadline, BASELINE_SHARE))
        stages.done("baselines")
        say("bound", 0.08)
        feasible = [c.iteration_time_s for c in base.candidates.values() if c.feasible]
        bound = lower_bound(prob, upper_s=min(feasible, default=None), deadline_s=_share_of(deadline, BOUND_SHARE))
        stages.done("bound")
        # kept back for what follows the lanes: the winner's explanation simulates it once
        reserve_s = RESERVE_SIMULATIONS * base.per_call_s
        grid = _grid(prob, deadline - reserve_s, base.per_call_s)
        stages.done(GRID_NAME)
        # data parallelism on fewer devices (search/objective.py), in part of the lanes' time
        subsets_end = time.perf_counter() + SUBSET_SHARE * max(0.0, deadline - reserve_s - time.perf_counter())
        subsets = subset_candidates(prob, goal, subsets_end, base.strategies.values())
        stages.done("subsets")
        grid_start = [grid.start] if grid.start is not None else []
        known = dict(base.known)
        if grid.start is not None and grid.candidate is not None:  # simulated already: not again in the lane
            known[grid.start.key()] = (as_estimate(prob, grid.candidate).score, grid.candidate)
        mine = Lane(
            name="search",
            seed=o.seed,
            starts=search_starts(base.strategies, warm, grid_start, base.unit_s),
            known=known,
        )
        found = Best()
        lane_stats, split = _run_lanes(prob, mine, other, forked, deadline - reserve_s, emit=found, say=say, **kw)
    finally:
        if forked is not None:
            forked.stop()
    split["reserve_s"] = reserve_s
    if grid.report:
        split[GRID_NAME] = grid.report
    split["baselines_skipped"] = list(base.skipped)
    if other is not None and other.start_name and o.finetune_s > 0:
        split["finetune_s"] = f"min({o.finetune_s:g}, half the GNN lane's time)"
    stages.done("lanes")
    say("scoring", 0.9)
    made = {GRID_NAME: grid.candidate} if grid.candidate is not None else {}
    # None where time ran out; FLOOR_MIN_S even when the lanes ran late (at the sizes the bound asked, it takes 1-25 ms)
    floor = plain_data_parallel_s(prob, deadline_s=max(deadline - base.per_call_s, time.perf_counter() + FLOOR_MIN_S))
    bound = replace(bound, plain_data_parallel_s=floor)
    best, ordered = _choose(prob, {**base.candidates, **made, **subsets}, found, bound, goal)
    stages.done("explanation")
    say("done", 1.0)
    return best, ordered, bound, lane_stats, split


def _grid(prob: Problem, end_s: float, per_call_s: float) -> GridBaseline:
    """The megatron-3d baseline (tp_moves.py) in GRID_SHARE of the time left before `end_s`
    (nothing, and nothing to report, for a model without transformer blocks)."""
    made = megatron_baseline(prob, _share_of(end_s, GRID_SHARE), per_call_s)
    return made if made is not None else GridBaseline(candidate=None, start=None, report={})


def _share_of(deadline_s: float, share: float) -> float:
    """The clock time `share` of the way from now to the deadline."""
    now = time.perf_counter()
    return now + share * max(0.0, deadline_s - now)


def _lane_table(lane_stats: list[LaneStats]) -> dict[str, dict[str, Any]]:
    """Each lane's figures by its name (a second lane of the same name numbered)."""
    lanes: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(lane_stats):
        lanes[r.name if r.name not in lanes else f"{r.name} ({i + 1})"] = r.to_dict()
    return lanes


def _has_simulator() -> bool:
    return _simulator() is not None


def _uses_simulator(scorer: str) -> bool:
    """Whether the chains' moves are scored by the simulator (plan_graph's `scorer`)."""
    return scorer == "simulator" or (scorer == "auto" and _has_simulator())


def _choose(
    prob: Problem, baselines: dict[str, Candidate], found: Best, bound: Bound, goal: Goal
) -> tuple[Plan, list[Candidate]]:
    """(the winner by `goal`'s objective among the feasible candidates (search/objective.py),
    explained; every candidate, in CANDIDATES order, then the subsets)."""
    candidates = dict(baselines)
    for name, c in found.by_name.items():
        if name not in candidates or c.rank < candidates[name].rank:
            candidates[name] = c
    cluster_doc = cluster_to_dict(prob.cluster)
    names = [n for n in CANDIDATES if n in candidates] + [n for n in candidates if n not in CANDIDATES]
    ordered = [_runnable(prob, candidates[n], cluster_doc, bound) for n in names]
    if not any(c.feasible for c in ordered):
        raise InfeasibleError(explain.infeasible_message(prob, ordered))
    choice = choose(prob, ordered, goal)
    return _finish(prob, choice.winner, list(choice.candidates), bound, choice.notes), list(choice.candidates)


def _runnable(prob: Problem, c: Candidate, cluster_doc: dict[str, Any], bound: Bound) -> Candidate:
    """The candidate with its prediction and the cluster spec in its plan, so that any
    candidate's plan (PlanResult.plan_of, `heterog plan --strategy`) runs as it is, and how far
    above the bound it is; one the executor could not cut (search/constraints.py) is infeasible."""
    plan = replace(c.plan.with_prediction(c.iteration_time_s, c.peak_memory_bytes), cluster=cluster_doc)
    cuts = prob.cuts
    broken = cuts is not None and violations(
        cuts, {n: gi for gi, g in enumerate(plan.groups) for n in g.nodes}, [g.replicas for g in plan.groups]
    )
    # a bound computed without tensor parallelism (the problem does not allow it) does not bound a split plan
    above = None if plan.tensor_parallel and not bound.tensor_parallel else bound.within(c.iteration_time_s)
    return replace(c, plan=plan, feasible=c.feasible and not broken, above_bound=above)


def _finish(
    prob: Problem, winner: Candidate, candidates: list[Candidate], bound: Bound, choice_notes: tuple[str, ...] = ()
) -> Plan:
    """Attach the explanation (prediction and cluster came with _runnable, priorities with
    scoring), and how the devices run the plan's precision (cost/precision.py)."""
    plan = replace(
        winner.plan,
        notes=tuple(explain.notes(prob, winner, candidates, bound, choice_notes))
        + precision_advice(prob.cluster, winner.plan.precision).notes,
    )
    return plan.validate(prob.graph, prob.cluster)
