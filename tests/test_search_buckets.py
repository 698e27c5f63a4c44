"""The gradient bucket size is part of a strategy: the estimate and the simulator read it, the
search moves it, and the plan, its warm start and its explanation carry it."""

import random
from dataclasses import replace

from heterog.search.baselines import even_dp
from heterog.search.estimate import estimate
from heterog.search.explain import bucket_note
from heterog.search.grouping import make_groups
from heterog.search.lanes import finalize
from heterog.search.moves import BUCKET_CHOICES_MIB, MOVES, MoveContext, bucket
from heterog.search.problem import BUCKET_BYTES, Problem
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster
from heterog.search.warm import warm_start

MIB = 2**20


def _prob() -> Problem:
    """Data parallelism on two nodes whose link makes the gradient sync as long as the backward."""
    g = layered_graph([(2.0, 8.0, 1.0)] * 12, batch_size=32)
    c = toy_cluster([10.0] * 4, devices_per_node=2, nic_gbs=0.5)
    costs = TableCostModel(graph=g, cluster=c)
    return Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 12), batch_size=32)


def test_small_buckets_overlap_the_sync_with_the_backward_in_estimate_and_simulator():
    prob = _prob()
    dp = even_dp(prob)
    one_bucket, small = replace(dp, bucket_bytes=2**30), replace(dp, bucket_bytes=MIB)
    assert estimate(prob, small).iteration_time_s < 0.9 * estimate(prob, one_bucket).iteration_time_s
    simulated = [finalize(prob, s, "x") for s in (one_bucket, small)]
    assert simulated[1].iteration_time_s < 0.9 * simulated[0].iteration_time_s
    assert [c.plan.bucket_bytes for c in simulated] == [2**30, MIB]


def test_the_bucket_move_steps_along_its_sizes_and_the_plan_keeps_them():
    prob = _prob()
    assert "bucket" in MOVES and MOVES["bucket"].when(prob)
    ctx = MoveContext(prob=prob, rng=random.Random(0))
    s, seen = even_dp(prob), set()
    for _ in range(60):
        s = bucket(ctx, s, 0, prob.n_groups)
        seen.add(s.bucket_bytes)
    assert seen == {int(m * MIB) for m in BUCKET_CHOICES_MIB}
    plan = prob.to_plan(replace(s, bucket_bytes=2 * MIB), "search")
    assert plan.bucket_bytes == 2 * MIB
    assert warm_start(prob, plan).bucket_bytes == 2 * MIB
    assert "buckets of up to 2.00 MiB" in bucket_note(plan)
    assert bucket_note(prob.to_plan(replace(s, bucket_bytes=BUCKET_BYTES), "search")) == ""
