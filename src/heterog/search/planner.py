"""The planner: from a model's graph, a cluster and costs to the best Plan and the table
of every candidate it compared (the capture and the costs before it: heterog/plan_module.py).

Order: group the graph → baselines → the GNN policy's proposals → simulated-annealing search
from the baselines and, separately, from the GNN's proposals → every candidate scored by the
simulator (heterog.simulate) → the best feasible one, explained. The best is the minimum over
all feasible candidates, so it is never worse than a baseline as the simulator scores them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from heterog.cost.model import CostModel
from heterog.cost.precision import precision_advice
from heterog.errors import InfeasibleError, PlanError, did_you_mean
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_to_dict
from heterog.ir.kinds import PipelineSchedule
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import ModelSpec, Plan
from heterog.search import explain
from heterog.search.baselines import BASELINE_BUILDERS, node_dp_starts, pipeline
from heterog.search.constraints import DEFAULT_CACHE, ConstraintCache, ModelCuts, violations
from heterog.search.estimate import Estimate, estimate
from heterog.search.grouping import make_groups
from heterog.search.local_search import Annealer
from heterog.search.problem import Problem, Strategy
from heterog.simulate.priorities import assign_priorities

CANDIDATES = (
    "single-device",
    "even-dp-allreduce",
    "even-dp-ps",
    "proportional-dp",
    "model-parallel",
    "pipeline",
    "search",
    "gnn",
    "gnn+search",
)
DEFAULT_BUDGET_S = 10.0
ELITE_RESCORED = 4  # strategies from each search that the simulator re-scores (at most)
PRIORITY_MAX_DEVICES = 128
FINAL_SIMULATIONS = 7  # after the search: search, gnn, gnn+search scored twice each, the winner explained


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    strategy: str
    plan: Plan
    iteration_time_s: float
    feasible: bool
    peak_memory_bytes: dict[str, int]
    scored_by: str  # 'simulator' or 'estimate'

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "iteration_time_s": self.iteration_time_s,
            "feasible": self.feasible,
            "peak_memory_bytes": self.peak_memory_bytes,
            "devices_used": len(self.plan.devices()),
            "num_microbatches": self.plan.num_microbatches,
            "scored_by": self.scored_by,
        }


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Plan
    candidates: tuple[Candidate, ...]
    search_time_s: float  # what --budget-s bounds
    other_time_s: dict[str, float] = field(default_factory=dict)  # what else planning took

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
        }


def _simulator() -> Callable | None:
    try:
        from heterog.simulate.simulator import simulate
    except ImportError:
        return None
    return simulate


def score_plan(prob: Problem, plan: Plan, strategy: Strategy) -> tuple[Plan, float, bool, dict[str, int], str]:
    """(plan, iteration_time_s, feasible, peak bytes per device, scorer), by the simulator when
    present. The simulator orders groups by the plan's priorities: the plan is scored with
    HEFT-style priorities (heterog.simulate.priorities) and in plain graph order, and the
    faster of the two is kept, so the prediction is for the plan exactly as returned."""
    sim = _simulator()
    if sim is not None:
        best = None
        # ranking a 1024-device plan's nodes costs seconds; large plans keep graph order
        variants = (
            (plan,)
            if prob.n_devices > PRIORITY_MAX_DEVICES
            else (assign_priorities(prob.graph, prob.cluster, plan, prob.costs, cache=prob.sim_cache), plan)
        )
        for p in variants:
            r = sim(prob.graph, prob.cluster, p, prob.costs, timeline=False, cache=prob.sim_cache)
            key = (not r.feasible, r.iteration_time_s)
            if best is None or key < best[0]:
                best = (key, p, r)
        _, p, r = best
        return (
            p,
            float(r.iteration_time_s),
            bool(r.feasible),
            {d: int(b) for d, b in r.peak_memory_bytes.items()},
            "simulator",
        )
    e = estimate(prob, prob.finalize(strategy))
    peak = {
        prob.device_names[i]: int(e.peak_memory_bytes[i]) for i in range(prob.n_devices) if e.peak_memory_bytes[i] > 0
    }
    return plan, e.iteration_time_s, e.feasible, peak, "estimate"


def _load_policy(policy: Any):
    if policy is False:
        return None
    # torch_geometric takes seconds to import: only when a GNN policy is used
    from heterog.search.gnn.policy import load_policy

    return load_policy(policy)


def simulator_scorer(prob: Problem) -> Callable[[Problem, Strategy], Estimate]:
    """The simulator as the search's scorer (plans in graph order, no timeline)."""
    sim = _simulator()
    assert sim is not None
    cap = prob.memory_bytes

    def score(p: Problem, s: Strategy) -> Estimate:
        r = sim(p.graph, p.cluster, p.to_plan(s, "search"), p.costs, timeline=False, cache=p.sim_cache)
        peak = np.zeros(p.n_devices)
        for d, b in r.peak_memory_bytes.items():
            peak[p.cluster.device_index[d]] = b
        overflow = float(np.max((peak - cap) / cap))
        return Estimate(
            iteration_time_s=float(r.iteration_time_s),
            peak_memory_bytes=peak,
            overflow=max(0.0, overflow) if not r.feasible else 0.0,
        )

    return score


def _candidate(prob: Problem, name: str, options: list[Strategy]) -> Candidate:
    """Score each option (the simulator when present) and keep the best for this name."""
    best_c = None
    for s in options:
        plan, t, ok, peak, how = score_plan(prob, prob.to_plan(s, name), s)
        c = Candidate(strategy=name, plan=plan, iteration_time_s=t, feasible=ok, peak_memory_bytes=peak, scored_by=how)
        if best_c is None or (not c.feasible, c.iteration_time_s) < (not best_c.feasible, best_c.iteration_time_s):
            best_c = c
    return best_c


def _options(best: Strategy, elite: list[tuple[float, Strategy]], limit: int) -> list[Strategy]:
    out, keys = [best], {best.key()}
    for _, s in elite:
        if len(out) > limit:
            break
        if s.key() not in keys:
            keys.add(s.key())
            out.append(s)
    return out


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
) -> PlanResult:
    """The best Plan for `graph` on `cluster` within about `budget_s` seconds.

    policy: None loads the shipped pre-trained GNN, a path loads that file, a policy object is
    used as is, False skips the GNN candidates. max_iters caps each search and makes the run
    reproducible (no choice then depends on timings; the budget is only a safety stop).
    scorer: what the search's inner loop calls — 'simulator', 'estimate', or 'auto' (the
    simulator when one call is cheap enough for a few hundred moves within the budget).
    finetune_s: seconds of REINFORCE on this very problem before the GNN proposes (a copy of
    the policy is tuned; the file is untouched). Taken from the budget.
    cuts: what the executor can cut (search/constraints.py); 'auto' exports `model_spec`'s
    model once per `cut_cache` (the module's default cache when None), None ignores them.
    Groups follow them, and a candidate that breaks them is reported infeasible.
    """
    started = time.perf_counter()
    if cuts == "auto":  # before the clock starts: an export (seconds, once per model) is not search time
        cuts = (cut_cache or DEFAULT_CACHE).get(model_spec) if model_spec is not None else None
    cuts_s = time.perf_counter() - started
    assert cuts is None or isinstance(cuts, ModelCuts), cuts
    # the simulator loaded before the clock too (about a second, cold): the baselines' scoring
    # times one call to size the search's budget, and an import inside it shrinks the budget
    _simulator()
    begin = time.perf_counter()
    say = progress or (lambda stage, frac: None)
    say("grouping", 0.0)
    groups = make_groups(graph, cluster, costs, max_groups, cuts)
    prob = Problem(
        graph=graph,
        cluster=cluster,
        costs=costs,
        groups=groups,
        batch_size=graph.batch_size,
        model_spec=model_spec,
        precision=precision,
        optimizer=optimizer,
        cuts=cuts,
    )
    strategies: dict[str, Strategy] = {name: build(prob) for name, build in BASELINE_BUILDERS.items()}
    say("baselines", 0.03)
    t0 = time.perf_counter()
    candidates = {name: _candidate(prob, name, [strategies[name]]) for name in BASELINE_BUILDERS}
    per_call_s = (time.perf_counter() - t0) / (2 * len(BASELINE_BUILDERS))
    say("baselines", 0.08)
    pol = _load_policy(policy)
    gnn_props: list[Strategy] = []
    if pol is not None:
        if finetune_s > 0:
            # torch_geometric takes seconds to import: only when a GNN policy is used
            from heterog.search.gnn.train import TrainConfig, train

            pol = copy.deepcopy(pol)
            train(pol, [prob], TrainConfig(steps=100_000, seed=seed), budget_s=finetune_s)
        gnn_props = pol.propose(prob, samples=8, seed=seed)
        strategies["gnn"] = min(gnn_props, key=lambda s: estimate(prob, s).score)
    say("gnn", 0.1)
    # what must follow the search fits the budget too: scoring its best strategies (twice each,
    # with and without priorities) and the explanation's simulation of the winner
    reserve_s = FINAL_SIMULATIONS * per_call_s
    left = max(0.0, budget_s - (time.perf_counter() - begin) - reserve_s) * 0.8
    share = 0.5 if gnn_props else 1.0
    have_sim = _simulator() is not None
    # with max_iters the run must not depend on the machine's speed: no timing-based choices
    timed = max_iters is None
    use_sim = scorer == "simulator" or (scorer == "auto" and timed and have_sim and per_call_s * 2000 <= left * share)
    score_fn = simulator_scorer(prob) if use_sim else estimate
    verify = simulator_scorer(prob) if (have_sim and not use_sim and scorer != "estimate") else None
    # the search also starts from a 1F1B pipeline: far less activation memory per stage, the
    # way into models that no baseline fits; and from data parallelism inside each node
    starts = (
        [strategies[n] for n in BASELINE_BUILDERS]
        + [pipeline(prob, PipelineSchedule.ONE_F_ONE_B)]
        + node_dp_starts(prob)
    )
    searched = Annealer(prob, seed, scorer=score_fn, verifier=verify).run(
        starts, budget_s=left * share, max_iters=max_iters, progress=lambda f: say("search", 0.1 + 0.8 * share * f)
    )
    strategies["search"] = searched.best
    pools = {"search": searched.elite}
    if gnn_props:
        both = Annealer(prob, seed + 1, scorer=score_fn, verifier=verify).run(
            gnn_props, budget_s=left * share, max_iters=max_iters, progress=lambda f: say("gnn+search", 0.5 + 0.4 * f)
        )
        strategies["gnn+search"] = both.best
        pools["gnn+search"] = both.elite
    say("scoring", 0.9)
    # re-score as many of each search's best strategies as the rest of the budget allows
    left = budget_s - (time.perf_counter() - begin)
    limit = max(0, min(ELITE_RESCORED, int(left / max(3 * 2 * per_call_s, 1e-9)) - 1)) if timed else ELITE_RESCORED
    for name in ("search", "gnn", "gnn+search"):
        if name in strategies:
            candidates[name] = _candidate(prob, name, _options(strategies[name], pools.get(name, []), limit))
    cluster_doc = cluster_to_dict(prob.cluster)
    ordered = [_runnable(prob, candidates[n], cluster_doc) for n in CANDIDATES if n in candidates]
    feasible = [c for c in ordered if c.feasible]
    if not feasible:
        raise InfeasibleError(explain.infeasible_message(prob, ordered))
    winner = min(feasible, key=lambda c: (c.iteration_time_s, CANDIDATES.index(c.strategy)))
    best = _finish(prob, winner, ordered)
    say("done", 1.0)
    return PlanResult(
        best=best,
        candidates=tuple(ordered),
        search_time_s=time.perf_counter() - begin,
        other_time_s={"cut_analysis": cuts_s},
    )


def _runnable(prob: Problem, c: Candidate, cluster_doc: dict[str, Any]) -> Candidate:
    """The candidate with its prediction and the cluster spec in its plan, so that any
    candidate's plan (PlanResult.plan_of, `heterog plan --strategy`) runs as it is; one the
    executor could not cut (search/constraints.py) is infeasible."""
    plan = replace(c.plan.with_prediction(c.iteration_time_s, c.peak_memory_bytes), cluster=cluster_doc)
    cuts = prob.cuts
    broken = cuts is not None and violations(
        cuts, {n: gi for gi, g in enumerate(plan.groups) for n in g.nodes}, [g.replicas for g in plan.groups]
    )
    return replace(c, plan=plan, feasible=c.feasible and not broken)


def _finish(prob: Problem, winner: Candidate, candidates: list[Candidate]) -> Plan:
    """Attach the explanation (prediction and cluster came with _runnable, priorities with
    scoring), and how the devices run the plan's precision (cost/precision.py)."""
    plan = replace(
        winner.plan,
        notes=tuple(explain.notes(prob, winner, candidates))
        + precision_advice(prob.cluster, winner.plan.precision).notes,
    )
    return plan.validate(prob.graph, prob.cluster)
