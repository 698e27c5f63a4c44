"""Baselines are valid Plans with the structure their names promise."""

import pytest

from heterog.search.baselines import BASELINE_BUILDERS, device_blocks, partition_stages
from heterog.search.estimate import estimate
from heterog.search.grouping import make_groups
from heterog.search.local_search import Annealer, segments
from heterog.search.problem import Problem
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster


@pytest.fixture(scope="module")
def prob():
    g = layered_graph([(1.0, 10, 1.0)] * 16, batch_size=64, skip_every=2)
    c = toy_cluster([30.0, 15.0, 15.0, 10.0], devices_per_node=2)
    costs = TableCostModel(graph=g, cluster=c)
    return Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=64)


def test_every_baseline_is_a_valid_plan(prob):
    for name, build in BASELINE_BUILDERS.items():
        plan = prob.to_plan(build(prob), name)
        plan.validate(prob.graph, prob.cluster)
        assert plan.strategy == name


def test_baseline_structures(prob):
    even = prob.finalize(BASELINE_BUILDERS["even-dp-allreduce"](prob))
    assert all(p.shares == (0.25,) * 4 and p.sync == "ring" for p in even.placements)
    ps = BASELINE_BUILDERS["even-dp-ps"](prob)
    assert {p.ps for p in ps.placements} == {0, 1, 2, 3}  # servers spread over the devices
    prop = BASELINE_BUILDERS["proportional-dp"](prob).placements[0]
    assert prop.shares[0] == pytest.approx(2 * prop.shares[1], rel=0.05)  # 30 vs 15 TFLOP/s
    mp = BASELINE_BUILDERS["model-parallel"](prob)
    assert all(len(p.devices) == 1 for p in mp.placements) and mp.microbatches == 1
    assert len({p.devices for p in mp.placements}) > 1
    pp = BASELINE_BUILDERS["pipeline"](prob)
    assert pp.microbatches > 1 and len(segments(pp)) > 1


def test_stage_partition_is_contiguous_and_favours_fast_blocks(prob):
    blocks = device_blocks(prob, 2)  # node 0 (30 + 15 TFLOP/s) and node 1 (15 + 10)
    ranges = partition_stages(prob, blocks)
    assert ranges[0][0] == 0 and ranges[-1][1] == prob.n_groups
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[0][1] - ranges[0][0] >= ranges[1][1] - ranges[1][0]


def test_every_search_move_keeps_the_strategy_valid(prob):
    ann = Annealer(prob, seed=2)
    s = BASELINE_BUILDERS["proportional-dp"](prob)
    for _ in range(300):
        s = ann.propose(s)
        assert len(s.placements) == prob.n_groups
        for p in s.placements:
            assert abs(sum(p.shares) - 1) < 1e-6 and len(set(p.devices)) == len(p.devices)
            assert (p.sync == "ps") == (p.ps is not None)
        prob.to_plan(s, "search").validate(prob.graph, prob.cluster)
        assert estimate(prob, s).iteration_time_s > 0
