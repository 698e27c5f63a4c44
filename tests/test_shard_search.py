"""Sharded state in the search: the shard-fraction LP, the two sharded baselines, the
estimate against the simulator on sharded plans, and a plan the search makes for a model
whose state fits no device whole.
"""

from __future__ import annotations

import numpy as np
import pytest

from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.estimate import estimate
from heterog.search.grouping import make_groups
from heterog.search.planner import plan_graph
from heterog.search.problem import Placement, Problem
from heterog.search.sharding import free_memory_fractions, minimax_fractions, replica_state_bytes
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster
from heterog.simulate.simulator import simulate

GB = 1e9


def test_the_shard_lp_leaves_the_fullest_device_as_empty_as_it_can():
    fixed = np.array([2.0, 1.0, 0.5]) * GB
    memory = np.array([8.0, 4.0, 4.0]) * GB
    f = minimax_fractions(fixed, 6 * GB, memory)
    level = (fixed + f * 6 * GB) / memory
    assert f.sum() == pytest.approx(1.0) and np.ptp(level) < 1e-6  # every device equally full
    # a device already over the level everyone else reaches gets nothing
    f = minimax_fractions(np.array([5.0, 0.0]) * GB, 1 * GB, np.array([4.0, 4.0]) * GB)
    assert f.tolist() == pytest.approx([0.0, 1.0])


@pytest.fixture(scope="module")
def tight():
    """Eight 250 MB layers trained with AdamW (8 GB of state) on four 4 GiB devices of two
    speeds: no device holds the state whole, a quarter of it fits everywhere."""
    g = layered_graph([(2.0, 250, 2.0)] * 8, batch_size=32)
    c = toy_cluster([40.0, 40.0, 20.0, 20.0], memory_gib=[4, 4, 4, 4], devices_per_node=2, nic_gbs=25)
    costs = TableCostModel(graph=g, cluster=c, optimizer="adamw")
    groups = make_groups(g, c, costs, 8)
    return Problem(graph=g, cluster=c, costs=costs, groups=groups, batch_size=32, optimizer="adamw")


def test_sharded_baselines_fit_where_data_parallelism_does_not(tight):
    prob = tight
    assert not estimate(prob, BASELINE_BUILDERS["even-dp-allreduce"](prob)).feasible
    fsdp = prob.finalize(BASELINE_BUILDERS["fsdp-even"](prob))
    assert all(p.shard == 3 and p.shards == (0.25,) * 4 and p.shares == (0.25,) * 4 for p in fsdp.placements)
    cephalo = prob.finalize(BASELINE_BUILDERS["zero-uneven"](prob))
    p = cephalo.placements[0]
    assert p.shard == 3 and p.shares[0] == pytest.approx(2 * p.shares[2], rel=0.1)  # batch ∝ speed
    assert p.shards == pytest.approx(free_memory_fractions(prob, range(prob.n_groups), p, 3, cephalo.microbatches))
    for s in (fsdp, cephalo):
        e = estimate(prob, s)
        r = simulate(prob.graph, prob.cluster, prob.to_plan(s, "x"), prob.costs)
        assert e.feasible and r.feasible
        # the estimate's memory is the simulator's within a fifth (it is the search's fast view)
        for i, d in enumerate(prob.device_names):
            assert e.peak_memory_bytes[i] == pytest.approx(r.peak_memory_bytes[d], rel=0.2), d


def test_a_shard_holds_its_fraction_of_the_state(tight):
    prob = tight
    whole = prob.persistent_bytes[0, 0]
    for stage, held in ((1, lambda f: 0.25 + 0.25 * f + 0.5 * f), (2, lambda f: 0.25 + 0.25 * f + 0.5 * f)):
        p = Placement((0, 1, 2, 3), (0.25,) * 4, "ring", None, False, stage, (0.1, 0.2, 0.3, 0.4))
        # AdamW: parameters, gradients, two optimizer copies; stage 1 keeps whole gradients too
        want = [(held(f) + (0.25 if stage == 1 else 0.0)) * whole for f in p.shards]
        assert replica_state_bytes(prob, 0, p) == pytest.approx(want)
    p = Placement((0, 1, 2, 3), (0.25,) * 4, "ring", None, False, 3, (0.1, 0.2, 0.3, 0.4))
    assert replica_state_bytes(prob, 0, p) == pytest.approx([f * whole for f in p.shards])


@pytest.mark.timeout(120)
def test_the_planner_shards_state_that_fits_no_device_whole_and_says_why(tight):
    prob = tight
    result = plan_graph(
        prob.graph, prob.cluster, prob.costs, budget_s=3, max_iters=300, policy=False, optimizer="adamw"
    )
    by = {c.strategy: c for c in result.candidates}
    assert by["fsdp-even"].feasible and by["zero-uneven"].feasible and not by["even-dp-allreduce"].feasible
    best = min(c.iteration_time_s for c in result.candidates if c.feasible)
    assert result.best.predicted_iteration_time_s == pytest.approx(best)
    if any(g.shard_stage for g in result.best.groups):
        assert any("ZeRO-" in n and "instead of" in n for n in result.best.notes)
    else:
        assert any("no state is sharded" in n for n in result.best.notes)
