"""The search starts from data parallelism inside each node (baselines.node_dp_starts), so a
plan that leaves out a node behind a slow link is a start, not a chain of annealing moves."""

import pytest

from heterog.search.baselines import node_dp_starts
from heterog.search.estimate import estimate
from heterog.search.grouping import make_groups
from heterog.search.local_search import Annealer
from heterog.search.problem import Problem
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster


def _prob(nic_gbs: float, speeds=(30.0, 15.0, 30.0, 15.0)) -> Problem:
    # parameter-heavy layers (40 MB each): data parallelism across nodes pays their gradients
    g = layered_graph([(1.0, 40, 1.0)] * 8, batch_size=64)
    c = toy_cluster(list(speeds), devices_per_node=2, nic_gbs=nic_gbs)
    costs = TableCostModel(graph=g, cluster=c)
    return Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=64)


def test_one_speed_proportional_start_per_kind_of_node_with_several_devices():
    assert [s.placements[0].devices for s in node_dp_starts(_prob(10.0))] == [(0, 1)]  # the nodes are alike
    prob = _prob(10.0, speeds=(30.0, 15.0, 20.0, 10.0))
    starts = node_dp_starts(prob)
    assert [s.placements[0].devices for s in starts] == [(0, 1), (2, 3)]
    for s in starts:
        p = s.placements[0]
        assert all(q == p for q in s.placements) and p.sync == "ring"
        assert p.shares[0] == pytest.approx(2 * p.shares[1], rel=0.05)  # 30 vs 15 TFLOP/s
        prob.to_plan(s, "node-dp").validate(prob.graph, prob.cluster)


def test_with_a_slow_link_the_search_keeps_to_one_node():
    prob = _prob(0.01)  # 10 MB/s between the nodes: 320 MB of gradients take 30 s or more
    start = node_dp_starts(prob)[0]
    result = Annealer(prob, 0).run([start], budget_s=5.0, max_iters=50)
    assert estimate(prob, result.best).score <= estimate(prob, start).score
    used = {d for p in result.best.placements for d in p.devices}
    assert {prob.node_idx[d] for d in used} == {0}


def test_the_planner_finds_data_parallelism_inside_the_fast_node():
    from heterog.search.planner import plan_graph

    prob = _prob(0.01)
    result = plan_graph(prob.graph, prob.cluster, prob.costs, budget_s=10.0, max_iters=20, policy=False, cuts=None)
    search = next(c for c in result.candidates if c.strategy == "search")
    base = min(c.iteration_time_s for c in result.candidates if c.strategy not in ("search", "gnn", "gnn+search"))
    assert {d for g in search.plan.groups for d in g.devices} <= {"n0/d0", "n0/d1"}
    assert search.iteration_time_s < 0.9 * base
