"""Batch-share optimiser: the LP balance, memory caps, integer samples."""

import numpy as np
import pytest

from heterog.search.grouping import make_groups
from heterog.search.problem import Problem
from heterog.search.shares import balanced_shares, integer_samples, optimal_shares
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster


def _problem(speeds, memory_gib=16.0, batch=100, layers=None):
    g = layered_graph(layers or [(1.0, 5, 1.0)] * 8, batch_size=batch)
    c = toy_cluster(speeds, memory_gib=memory_gib)
    costs = TableCostModel(graph=g, cluster=c)
    return Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 4), batch_size=batch)


def test_one_device_four_times_faster_gets_four_fifths():
    prob = _problem([40.0, 10.0])
    devs, shares = balanced_shares(prob, range(prob.n_groups), [0, 1])
    assert devs == (0, 1)
    assert shares[0] / shares[1] == pytest.approx(4.0, rel=0.05)


def test_lp_matches_closed_form_without_fixed_costs():
    per = np.array([1.0, 2.0, 4.0])
    s = optimal_shares(np.zeros(3), per, 70)
    np.testing.assert_allclose(s, (1 / per) / (1 / per).sum(), rtol=1e-6)


def test_memory_cap_bounds_the_fast_device_share():
    per = np.array([1.0, 4.0])  # device 0 is 4x faster but may hold at most 50% of the batch
    s = optimal_shares(np.zeros(2), per, 10, cap=np.array([0.5, 1.0]))
    assert s[0] == pytest.approx(0.5, abs=1e-6)
    assert s.sum() == pytest.approx(1.0)


def test_caps_too_small_give_least_overflow_split():
    s = optimal_shares(np.zeros(2), np.array([1.0, 1.0]), 10, cap=np.array([0.2, 0.6]))
    np.testing.assert_allclose(s, [0.25, 0.75])


def test_integer_samples_sum_and_balance():
    fixed = np.zeros(3)
    per = np.array([1.0, 2.0, 2.0])
    counts = integer_samples(np.array([0.5, 0.25, 0.25]), 7, fixed, per)
    assert counts.sum() == 7
    times = per * counts
    assert times.max() <= 4.0 + 1e-9  # 3,2,2 → 3,4,4 (the best split of 7)


def test_memory_bound_shares_in_real_problem():
    # the fast device has little memory: its share must stay below its cap
    layers = [(1.0, 1, 50.0)] * 4  # 50 MB activations per sample per layer
    prob = _problem([40.0, 10.0], memory_gib=[2.0, 16.0], batch=64, layers=layers)
    devs, shares = balanced_shares(prob, range(prob.n_groups), [0, 1])
    act = 4 * 50e6 * 64
    assert shares[0] * act <= prob.memory_bytes[0]
    assert shares[0] < 0.8  # below the 4:1 split it would get without the cap
