"""The planner: from a model (or its graph), a cluster and costs to the best Plan and the table
of every candidate it compared.

Order: group the graph → baselines → the GNN policy's proposals → simulated-annealing search
from the baselines and, separately, from the GNN's proposals → every candidate scored by the
simulator (heterog.simulate) → the best feasible one, explained. The best is the minimum over
all feasible candidates, so it is never worse than a baseline as the simulator scores them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from heterog.cost.model import CostModel
from heterog.errors import InfeasibleError
from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import ModelSpec, Plan
from heterog.search import explain
from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.estimate import estimate
from heterog.search.grouping import make_groups
from heterog.search.local_search import anneal
from heterog.search.problem import Problem, Strategy

CANDIDATES = ("single-device", "even-dp-allreduce", "even-dp-ps", "proportional-dp", "model-parallel",
              "pipeline", "search", "gnn", "gnn+search")
DEFAULT_BUDGET_S = 10.0
ELITE_RESCORED = 4  # strategies from each search that the simulator re-scores


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    strategy: str
    plan: Plan
    iteration_time_s: float
    feasible: bool
    peak_memory_bytes: dict[str, int]
    scored_by: str  # 'simulator' or 'estimate'

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "iteration_time_s": self.iteration_time_s,
                "feasible": self.feasible, "peak_memory_bytes": self.peak_memory_bytes,
                "devices_used": len(self.plan.devices()), "num_microbatches": self.plan.num_microbatches,
                "scored_by": self.scored_by}


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Plan
    candidates: tuple[Candidate, ...]
    search_time_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
                "search_time_s": self.search_time_s}


def _simulator() -> Callable | None:
    try:
        from heterog.simulate.simulator import simulate
    except ImportError:
        return None
    return simulate


def score_plan(prob: Problem, plan: Plan, strategy: Strategy) -> tuple[float, bool, dict[str, int], str]:
    """(iteration_time_s, feasible, peak bytes per device, scorer): the simulator when present."""
    sim = _simulator()
    if sim is not None:
        r = sim(prob.graph, prob.cluster, plan, prob.costs)
        return (float(r.iteration_time_s), bool(r.feasible),
                {d: int(b) for d, b in r.peak_memory_bytes.items()}, "simulator")
    e = estimate(prob, prob.finalize(strategy))
    peak = {prob.device_names[i]: int(e.peak_memory_bytes[i]) for i in range(prob.n_devices)
            if e.peak_memory_bytes[i] > 0}
    return e.iteration_time_s, e.feasible, peak, "estimate"


def _load_policy(policy: Any):
    if policy is False:
        return None
    from heterog.search.gnn.policy import load_policy
    return load_policy(policy)


def plan_graph(graph: OpGraph, cluster: Cluster, costs: CostModel, *, budget_s: float = DEFAULT_BUDGET_S,
               seed: int = 0, max_groups: int = 32, policy: Any = None, model_spec: ModelSpec | None = None,
               precision: str = "fp32", optimizer: str = "sgd", max_iters: int | None = None,
               progress: Callable[[str, float], None] | None = None) -> PlanResult:
    """The best Plan for `graph` on `cluster` within about `budget_s` seconds.

    policy: None loads the shipped pre-trained GNN, a path loads that file, a policy object is
    used as is, False skips the GNN candidates. max_iters caps each search (reproducible runs).
    """
    begin = time.perf_counter()
    say = progress or (lambda stage, frac: None)
    say("grouping", 0.0)
    groups = make_groups(graph, cluster, costs, max_groups)
    prob = Problem(graph=graph, cluster=cluster, costs=costs, groups=groups, batch_size=graph.batch_size,
                   model_spec=model_spec, precision=precision, optimizer=optimizer)
    strategies: dict[str, Strategy] = {name: build(prob) for name, build in BASELINE_BUILDERS.items()}
    say("baselines", 0.05)
    pol = _load_policy(policy)
    gnn_props: list[Strategy] = []
    if pol is not None:
        gnn_props = pol.propose(prob, samples=8, seed=seed)
        strategies["gnn"] = min(gnn_props, key=lambda s: estimate(prob, s).score)
    say("gnn", 0.1)
    left = max(0.0, budget_s - (time.perf_counter() - begin)) * 0.85
    share = 0.5 if gnn_props else 1.0
    baseline_starts = [strategies[n] for n in BASELINE_BUILDERS]
    searched = anneal(prob, baseline_starts, budget_s=left * share, seed=seed, max_iters=max_iters,
                      progress=lambda f: say("search", 0.1 + 0.8 * share * f))
    strategies["search"] = searched.best
    pools = {"search": searched.elite}
    if gnn_props:
        both = anneal(prob, gnn_props, budget_s=left * share, seed=seed + 1, max_iters=max_iters,
                      progress=lambda f: say("gnn+search", 0.5 + 0.4 * f))
        strategies["gnn+search"] = both.best
        pools["gnn+search"] = both.elite
    say("scoring", 0.9)
    candidates: list[Candidate] = []
    for name in CANDIDATES:
        if name not in strategies:
            continue
        options = [strategies[name]]
        for _, s in pools.get(name, [])[:ELITE_RESCORED]:
            if s.key() != options[0].key():
                options.append(s)
        best_c = None
        for s in options:  # the simulator picks among the search's few best (its estimate may err)
            plan = prob.to_plan(s, name)
            t, ok, peak, how = score_plan(prob, plan, s)
            c = Candidate(strategy=name, plan=plan, iteration_time_s=t, feasible=ok, peak_memory_bytes=peak,
                          scored_by=how)
            if best_c is None or (c.feasible, -c.iteration_time_s) > (best_c.feasible, -best_c.iteration_time_s):
                best_c = c
        candidates.append(best_c)
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        raise InfeasibleError(explain.infeasible_message(prob, candidates))
    winner = min(feasible, key=lambda c: (c.iteration_time_s, CANDIDATES.index(c.strategy)))
    best = _finish(prob, winner, candidates)
    say("done", 1.0)
    return PlanResult(best=best, candidates=tuple(candidates), search_time_s=time.perf_counter() - begin)


def _finish(prob: Problem, winner: Candidate, candidates: list[Candidate]) -> Plan:
    """Attach prediction, execution priorities, the cluster spec and the explanation."""
    from dataclasses import replace

    from heterog.hardware.spec import cluster_to_dict
    plan = winner.plan.with_prediction(winner.iteration_time_s, winner.peak_memory_bytes)
    plan = replace(plan, cluster=cluster_to_dict(prob.cluster), priorities=explain.priorities(prob, plan),
                   notes=tuple(explain.notes(prob, winner, candidates)))
    return plan.validate(prob.graph, prob.cluster)


def plan(model: str, *, model_args: dict[str, Any] | None = None, batch_size: int, seq_len: int | None = None,
         cluster: str | Cluster, precision: str = "fp32", optimizer: str = "sgd",
         budget_s: float = DEFAULT_BUDGET_S, seed: int = 0, policy: Any = None,
         progress: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Capture `model`, load `cluster`, build the cost model and plan. Returns the CLI's JSON:
    {"best": plan dict, "candidates": [...], "search_time_s"}."""
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster

    clu = load_cluster(cluster) if isinstance(cluster, str) else cluster
    graph = capture_model(model, model_args, batch_size=batch_size, seq_len=seq_len)
    costs = build_cost_model(graph, clu, precision=precision, optimizer=optimizer)
    spec = ModelSpec(name=model, args=dict(model_args or {}), batch_size=batch_size, seq_len=seq_len)
    result = plan_graph(graph, clu, costs, budget_s=budget_s, seed=seed, policy=policy, model_spec=spec,
                        precision=precision, optimizer=optimizer, progress=progress)
    return result.to_dict()
