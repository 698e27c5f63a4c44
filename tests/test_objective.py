"""The planner's objective (search/objective.py) on synthetic clusters with made-up prices:
a slow cheap device used or dropped as the prices say, --max-cost-per-hour honoured, and the
tolerance rule that prefers the simpler plan, says so, and is off at 0."""

import json
from pathlib import Path

import pytest

import heterog
from heterog.errors import PlanError
from heterog.hardware.spec import load_cluster, with_prices
from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import Plan
from heterog.search.grouping import make_groups
from heterog.search.lanes import Candidate
from heterog.search.objective import DEFAULT_TOLERANCE, Goal, choose
from heterog.search.planner import plan_graph
from heterog.search.problem import Placement, Problem, Strategy
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster

FAST, SLOW = "synth-40tf-16g", "synth-10tf-16g"
QUICK = {"budget_s": 20, "max_iters": 10, "policy": False}
LAYERS = [(1.0, 1, 1.0)] * 8  # compute-heavy, few parameters: data parallelism scales


def _plan(speeds, goal: Goal, prices: dict[str, float] | None = None):
    g = layered_graph(LAYERS, batch_size=64)
    c = toy_cluster(list(speeds), devices_per_node=2)
    c = with_prices(c, prices) if prices else c
    costs = TableCostModel(graph=g, cluster=c)
    return plan_graph(g, c, costs, budget_s=60, policy=False, max_iters=30, workers=1, cuts=None, goal=goal)


def test_a_slow_cheap_device_is_used_when_cheap_enough_and_dropped_when_dear():
    cost = Goal(objective="cost", tolerance=0.0)
    cheap = _plan((40.0, 10.0), cost, {FAST: 1.0, SLOW: 0.05})  # 4× slower at 1/20 of the price
    assert "n0/d1" in cheap.best.devices()
    assert any(n.startswith("objective cost: $") for n in cheap.best.notes)
    dear = _plan((40.0, 10.0), cost, {FAST: 1.0, SLOW: 1.0})  # 4× slower at the same price
    assert dear.best.devices() == ("n0/d0",)
    c = dear.best.predicted_cost
    assert c["usd_per_hour"] == 1.0 and c["usd_per_step"] == pytest.approx(dear.best.predicted_iteration_time_s / 3600)
    assert c["usd_per_million_samples"] == pytest.approx(c["usd_per_step"] / 64 * 1e6)
    # the time objective uses both devices either way: the fastest plan
    assert len(_plan((40.0, 10.0), Goal(tolerance=0.0), {FAST: 1.0, SLOW: 1.0}).best.devices()) == 2


def test_max_cost_per_hour_gives_the_fastest_plan_within_it():
    prices = {FAST: 1.0, SLOW: 0.3}
    both = _plan((40.0, 10.0), Goal(max_cost_per_hour=2.0, tolerance=0.0), prices)
    assert len(both.best.devices()) == 2  # both devices cost 1.3 per hour: within 2
    capped = _plan((40.0, 10.0), Goal(max_cost_per_hour=1.1, tolerance=0.0), prices)
    assert capped.best.devices() == ("n0/d0",) and capped.best.predicted_cost["usd_per_hour"] <= 1.1
    assert capped.best.predicted_iteration_time_s > both.best.predicted_iteration_time_s
    assert any("within --max-cost-per-hour $1.1" in n and "devices left idle" in n for n in capped.best.notes)
    with pytest.raises(PlanError, match="no plan found runs within --max-cost-per-hour \\$0.2"):
        _plan((40.0, 10.0), Goal(max_cost_per_hour=0.2), prices)


def test_within_the_tolerance_fewer_devices_are_chosen_and_the_notes_say_so():
    # a 40-TF device and a 2-TF one: both together are a few % faster than the fast one alone
    on = _plan((40.0, 2.0), Goal())
    assert on.best.devices() == ("n0/d0",)
    note = next(n for n in on.best.notes if n.startswith("a plan on 1 device within"))
    assert "of the fastest" in note and "on 2 devices" in note and "8.3 %" in note
    off = _plan((40.0, 2.0), Goal(tolerance=0.0))
    assert len(off.best.devices()) == 2
    assert off.best.predicted_iteration_time_s < on.best.predicted_iteration_time_s
    assert not any(n.startswith("a plan on") for n in off.best.notes)


def test_within_the_tolerance_one_sync_method_is_preferred():
    g = layered_graph(LAYERS, batch_size=64)
    c = toy_cluster([40.0, 40.0], devices_per_node=2)
    costs = TableCostModel(graph=g, cluster=c)
    prob = Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 4), batch_size=64)
    ring, ps = Placement((0, 1), (0.5, 0.5), SyncMethod.RING), Placement((0, 1), (0.5, 0.5), SyncMethod.PS, 0)
    one = Strategy(tuple(ring for _ in range(prob.n_groups)))
    two = Strategy(tuple(ring if i % 2 else ps for i in range(prob.n_groups)))

    def cand(name: str, s: Strategy, time_s: float) -> Candidate:
        return Candidate(
            strategy=name, plan=prob.to_plan(s, name), iteration_time_s=time_s, feasible=True,
            peak_memory_bytes={}, scored_by="simulator",
        )  # fmt: skip

    cands = [cand("two-syncs", two, 1.00), cand("one-sync", one, 1.03)]
    picked = choose(prob, cands, Goal())
    assert picked.winner.strategy == "one-sync" and "one sync method" in picked.notes[0]
    assert choose(prob, cands, Goal(tolerance=0.0)).winner.strategy == "two-syncs"


def test_the_default_tolerance_is_the_cost_models_measured_median_error():
    doc = json.loads((Path(__file__).parents[1] / "benchmarks/results/predict_gpu.json").read_text())
    assert DEFAULT_TOLERANCE == round(doc["summary"]["h200"]["all"]["median_time_error"], 3)


def test_the_python_api_takes_the_objective_and_every_candidate_carries_its_cost():
    cluster = with_prices(load_cluster("emulated-4"), {"cpu": 0.1})
    r = heterog.plan("mlp", batch_size=8, cluster=cluster, objective="cost", tolerance=0.0, **QUICK)
    cost = r["best"]["predicted_cost"]
    assert cost["usd_per_hour"] == pytest.approx(0.1 * len(Plan.from_dict(r["best"]).devices()))
    assert all(c["cost"]["usd_per_hour"] == pytest.approx(0.1 * c["devices_used"]) for c in r["candidates"])
    assert min(c["cost"]["usd_per_step"] for c in r["candidates"] if c["feasible"]) == cost["usd_per_step"]


def test_a_goal_and_the_separate_objective_arguments_together_are_refused():
    with pytest.raises(PlanError, match="both goal= and objective"):
        heterog.plan("mlp", batch_size=8, cluster="emulated-4", goal=Goal(), tolerance=0.0, **QUICK)
