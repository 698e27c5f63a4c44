"""Tensor parallelism in the search: the tp move's plans are ones the simulator accepts and
prices as simulate() does, refused neighbours are never accepted, the planner splits a small
transformer's groups on a node of NVLink GPUs where that is fastest, and planning for a run
keeps to what the switch allows (lower/tensor_parallel.py executor_tensor_parallel)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import pytest
from typer.testing import CliRunner

from heterog.capture import capture_model
from heterog.cli.main import app
from heterog.hardware.spec import load_cluster, parse_cluster_yaml
from heterog.inputs import model_inputs
from heterog.ir.kinds import Phase, SyncMethod
from heterog.ir.plan import ModelSpec
from heterog.lower.tensor_parallel import TensorParallelSupport, executor_tensor_parallel, runnable
from heterog.runs.elastic import replan
from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.bound import lower_bound
from heterog.search.bound_tp import tp_relaxation
from heterog.search.grouping import make_groups
from heterog.search.lanes import simulator_scorer
from heterog.search.moves import MoveContext, segments, with_placement
from heterog.search.planner import plan_graph
from heterog.search.problem import Placement, Problem
from heterog.search.tp_moves import (
    GRID_NAME,
    SPLIT_PLAN_CALLS,
    megatron_baseline,
    tp_applies,
    tp_move,
    whole_regions,
)
from heterog.search.tp_scoring import simulated, split_groups, tp_conflict
from heterog.simulate.simulator import simulate
from heterog.simulate.tensor_parallel import tensor_parallel_inputs

SMALL = ModelSpec(name="gpt2", args={"layers": 4}, batch_size=8, seq_len=32)
# one sample: data parallelism and pipelines cannot use a second GPU, tensor parallelism can
ONE = ModelSpec(name="gpt2", args={"layers": 2}, batch_size=1, seq_len=512)
NVLINK_NODE = """
name: nvlink-4
kind: real
description: one node of 4x A100-80GB (NVLink)
nodes:
  - name: a100
    nic_bandwidth_gbps: 100
    devices:
      - {type: A100-80GB, count: 4}
"""


def _problem(spec: ModelSpec, cluster, max_groups: int = 32, *, whole: bool = True) -> Problem:
    graph = capture_model(spec.name, dict(spec.args), batch_size=spec.batch_size, seq_len=spec.seq_len)
    graph, cluster, costs = model_inputs(spec, cluster, graph=graph)
    groups = make_groups(graph, cluster, costs, max_groups)
    return Problem(
        graph=graph,
        cluster=cluster,
        costs=costs,
        groups=whole_regions(graph, costs, groups) if whole else groups,
        batch_size=spec.batch_size,
        model_spec=spec,
        tensor_parallel=TensorParallelSupport.ANY,
    )


@pytest.fixture(scope="module")
def mixed():
    """gpt2 with 4 blocks on mixed-16: nodes of 4 A100s, 4 V100s and 8 T4s."""
    return _problem(SMALL, load_cluster("mixed-16"))


def test_grouping_keeps_split_regions_whole(mixed):
    plain = _problem(SMALL, mixed.cluster, 12, whole=False)
    assert split_groups(plain), "the plain grouping cuts some block's split region"
    whole = _problem(SMALL, mixed.cluster, 12)
    assert not split_groups(whole) and tp_applies(whole)
    assert [n for g in whole.groups for n in g] == [n.name for n in whole.graph.nodes]  # still contiguous


def test_tp_move_gives_plans_the_simulator_accepts_and_prices_alike(mixed):
    ctx = MoveContext(prob=mixed, rng=random.Random(0))
    bound = lower_bound(mixed)
    assert bound.tensor_parallel
    degrees, undone = set(), 0
    for name in ("proportional-dp", "pipeline", "zero-uneven"):
        s = BASELINE_BUILDERS[name](mixed)
        for _ in range(6):
            a, b = ctx.rng.choice(segments(s))
            n = tp_move(ctx, s, a, b)
            if n is s:
                continue
            plan = mixed.to_plan(n, "search").validate(mixed.graph, mixed.cluster)
            assert tp_conflict(mixed, n) is None
            for g in plan.groups:
                for r in g.replicas:  # a set stays inside one node, on one GPU type
                    assert len({mixed.cluster.node_of[m] for m in r.members}) == 1
                    assert len({mixed.cluster.device(m).gpu_type for m in r.members}) == 1
            kept = simulated(mixed, plan, simulate)  # the search's cached split inputs
            fresh = simulate(mixed.graph, mixed.cluster, plan, mixed.costs, timeline=False)
            assert fresh.iteration_time_s >= bound.iteration_time_s  # the bound holds for split plans
            assert kept.iteration_time_s == pytest.approx(fresh.iteration_time_s, rel=1e-9)
            assert kept.peak_memory_bytes == fresh.peak_memory_bytes
            degrees.add(n.placements[a].tp_degree)
            undone += s.placements[a].tp_degree > 1 and n.placements[a].tp_degree == 1
            s = n
    assert {2, 4} <= degrees and undone, (degrees, undone)


def test_the_bound_times_a_member_as_the_simulator_does(mixed):
    """A set's member in the bound (bound_tp.member_s) costs what the simulator's cost model of
    that plan gives it, at every size: the split GEMMs at their own size, the all-reduces over
    the set's links."""
    relax = tp_relaxation(mixed)
    ctx = MoveContext(prob=mixed, rng=random.Random(2))
    s = BASELINE_BUILDERS["proportional-dp"](mixed)
    checked = set()
    for _ in range(40):
        n = tp_move(ctx, s, *ctx.rng.choice(segments(s)))
        plan = mixed.to_plan(n, "search")
        for g, (placement, group) in enumerate(zip(n.placements, plan.groups)):
            if placement.tp_degree == 1 or g in checked:
                continue
            _, _, costs = tensor_parallel_inputs(mixed.graph, mixed.cluster, plan, mixed.costs)
            lead = group.replicas[0].device
            t = mixed.tier_of[mixed.device_names.index(lead)]
            for b, (fwd, bwd) in zip((1, 3, 8), relax.member_s(mixed, t, g, placement.tp_degree, [1, 3, 8])):
                assert fwd == pytest.approx(costs.group_time_s(group.nodes, lead, b, Phase.FORWARD), rel=1e-9)
                assert bwd == pytest.approx(costs.group_time_s(group.nodes, lead, b, Phase.BACKWARD), rel=1e-9)
            checked.add(g)
    assert len(checked) >= 2, checked


def test_the_grid_is_skipped_where_a_split_plans_first_simulation_does_not_fit(mixed):
    now = time.perf_counter()
    skipped = megatron_baseline(mixed, now + (SPLIT_PLAN_CALLS - 1) * 0.5, 0.5)
    assert skipped.candidate is None and "split plan's first simulation" in skipped.report["skipped"]


def test_neighbours_the_simulator_refuses_are_rejected(mixed):
    ctx = MoveContext(prob=mixed, rng=random.Random(1))
    s = BASELINE_BUILDERS["proportional-dp"](mixed)
    n = s
    while n is s or n.placements[0].tp_degree == 1:
        n = tp_move(ctx, s, 0, mixed.n_groups)
    p = n.placements[0]
    member = p.tp[0][0]
    alone = with_placement(n, 0, 1, Placement((member,), (1.0,)))  # a set's member also alone
    by_ps = with_placement(n, 0, mixed.n_groups, dataclasses.replace(p, sync=SyncMethod.PS, ps=p.devices[0]))
    score = simulator_scorer(mixed)
    for bad, why in ((alone, "two tensor-parallel sets"), (by_ps, "not ring")):
        assert why in tp_conflict(mixed, bad)
        assert math.isinf(score(mixed, bad).score)
    assert math.isfinite(score(mixed, n).score)


@pytest.fixture(scope="module")
def one_sample():
    spec = ONE
    graph = capture_model(spec.name, dict(spec.args), batch_size=spec.batch_size, seq_len=spec.seq_len)
    return spec, model_inputs(spec, parse_cluster_yaml(NVLINK_NODE), graph=graph)


def test_planner_splits_blocks_on_nvlink_and_planning_for_a_run_keeps_to_what_runs(one_sample):
    spec, (graph, cluster, costs) = one_sample
    kw = {"budget_s": 3, "policy": False, "max_iters": 100, "model_spec": spec, "cuts": None}
    r = plan_graph(graph, cluster, costs, **kw)
    assert r.best.tensor_parallel, [(c.strategy, c.iteration_time_s) for c in r.candidates]
    assert any("Megatron-style" in n for n in r.best.notes), r.best.notes
    assert r.bound.tensor_parallel and any("of a lower bound" in n for n in r.best.notes), r.best.notes
    assert all(c.above_bound >= -1e-9 for c in r.candidates if c.feasible)  # split plans above it too
    assert r.bound.within(r.best.predicted_iteration_time_s) < 0.10  # members timed as the simulator does
    grid = next(c for c in r.candidates if c.strategy == GRID_NAME)
    assert grid.plan.tensor_parallel and r.best.predicted_iteration_time_s <= grid.iteration_time_s
    assert r.budget_split[GRID_NAME]["scored"] >= 1
    unsplit = min(c.iteration_time_s for c in r.candidates if not c.plan.tensor_parallel)
    assert r.best.predicted_iteration_time_s < 0.9 * unsplit  # one sample over four GPUs, not one
    # planning for a run: the switch; the executor runs one degree for every group (runnable)
    for support in {executor_tensor_parallel(), TensorParallelSupport.UNIFORM}:
        run_bound = plan_graph(graph, cluster, costs, tensor_parallel=support, **kw)
        for c in run_bound.candidates:
            assert support != TensorParallelSupport.NONE or not c.plan.tensor_parallel
            runnable(c.plan, "a run")
        if support == TensorParallelSupport.UNIFORM:
            assert run_bound.best.tensor_parallel
    again = replan(r.best, cluster, 3.0, graph=graph)  # an elastic run's re-plan, warm from the TP plan
    assert executor_tensor_parallel() != TensorParallelSupport.NONE or not again.tensor_parallel


def test_cli_no_tensor_parallel(tmp_path):
    path = tmp_path / "nvlink.yaml"
    path.write_text(NVLINK_NODE)
    args = ["plan", "--model", "gpt2", "--model-arg", "layers=2", "--batch-size", "1", "--seq-len", "512"]
    args += ["--cluster", str(path), "--budget-s", "3", "--no-gnn", "--max-iters", "60", "--json"]
    res = CliRunner().invoke(app, [*args, "--no-tensor-parallel"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert "tp_devices" not in json.dumps(doc["best"])
