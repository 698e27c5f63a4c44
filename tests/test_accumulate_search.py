"""Per-replica gradient accumulation in the search: the estimate prices it as the simulator
does, `zero-uneven` sets each replica's count so its activations fit (Cephalo's rule), the
`accumulate` move keeps plans valid, and the explanation says which replicas accumulate.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.estimate import estimate
from heterog.search.explain import accumulation_note
from heterog.search.grouping import make_groups
from heterog.search.moves import MoveContext
from heterog.search.problem import Problem, Strategy
from heterog.search.sharding import accumulate_move, activations_bound, fitting_counts
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster
from heterog.simulate.simulator import simulate


@pytest.fixture(scope="module")
def pressed():
    """Eight layers of 60 MB activations per sample, batch 32, on two fast 4 GiB devices and
    two half-as-fast 16 GiB ones: a fast device's share by speed (10 samples, 5 GB of
    activations) fits only in pieces."""
    g = layered_graph([(2.0, 25, 60.0)] * 8, batch_size=32)
    c = toy_cluster([40.0, 40.0, 20.0, 20.0], memory_gib=[4, 4, 16, 16], devices_per_node=2, nic_gbs=25)
    costs = TableCostModel(graph=g, cluster=c, optimizer="adamw")
    return Problem(
        graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=32, optimizer="adamw"
    )


def test_zero_uneven_accumulates_on_the_fast_small_devices_and_fits(pressed):
    prob = pressed
    assert activations_bound(prob)
    s = prob.finalize(BASELINE_BUILDERS["zero-uneven"](prob))
    p = s.placements[0]
    assert all(q == p for q in s.placements) and p.shard == 2
    assert p.accumulate[0] > 1 and p.accumulate[1] > 1, p  # the 4 GiB devices run pieces
    assert p.shares[0] > p.shares[2]  # batch ∝ speed
    plan = prob.to_plan(s, "zero-uneven")
    assert [r.accumulate for r in plan.groups[0].replicas] == list(p.accumulate)
    e = estimate(prob, s)
    r = simulate(prob.graph, prob.cluster, plan, prob.costs)
    assert e.feasible and r.feasible
    for i, d in enumerate(prob.device_names):  # the estimate is the simulator's within a fifth
        assert e.peak_memory_bytes[i] == pytest.approx(r.peak_memory_bytes[d], rel=0.2), d
    assert "in 1 pieces" not in accumulation_note(plan)
    assert accumulation_note(plan).startswith("gradient accumulation per replica: n0/d0 10 samples in 2 pieces, n0/d1")
    # without the counts the same plan does not fit
    flat = Strategy(tuple(replace(q, accumulate=()) for q in s.placements), s.microbatches, s.schedule)
    assert not simulate(prob.graph, prob.cluster, prob.to_plan(flat, "x"), prob.costs).feasible


def test_the_estimates_peak_falls_with_a_count_as_the_simulators(pressed):
    prob = pressed
    p = replace(prob.finalize(BASELINE_BUILDERS["proportional-dp"](prob)).placements[0], accumulate=())
    est, sim = [], []
    for k in (1, 2, 4):
        q = replace(p, accumulate=(k,) + (1,) * (len(p.devices) - 1) if k > 1 else ())
        s = Strategy((q,) * prob.n_groups)
        est.append(estimate(prob, s).peak_memory_bytes[0])
        sim.append(simulate(prob.graph, prob.cluster, prob.to_plan(s, "x"), prob.costs).peak_memory_bytes["n0/d0"])
    assert est[0] > est[1] > est[2] and sim[0] > sim[1] > sim[2]
    assert np.allclose(est, sim, rtol=0.2)


def test_the_accumulate_move_sets_counts_only_where_they_are_defined(pressed):
    prob = pressed
    ctx = MoveContext(prob=prob, rng=random.Random(0))
    dp = prob.finalize(BASELINE_BUILDERS["proportional-dp"](prob))
    counted = {accumulate_move(ctx, dp, 0, prob.n_groups).placements[0].accumulate for _ in range(20)}
    assert fitting_counts(prob, dp.placements[0], dp.microbatches) in counted and len(counted) > 1
    for _ in range(10):  # every neighbour lowers to a valid plan
        s = accumulate_move(ctx, dp, 0, prob.n_groups)
        prob.to_plan(prob.finalize(s), "x").validate(prob.graph, prob.cluster)
    pipeline = prob.finalize(BASELINE_BUILDERS["pipeline"](prob))
    if len(set(pipeline.placements)) > 1:
        assert accumulate_move(ctx, pipeline, 0, prob.n_groups) is pipeline
