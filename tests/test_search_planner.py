"""The planner: candidates, best ≤ every baseline, infeasible answers, reproducibility, CLI."""

import json

import pytest

from heterog.errors import InfeasibleError
from heterog.ir.plan import Plan
from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.estimate import estimate
from heterog.search.grouping import make_groups
from heterog.search.local_search import Annealer
from heterog.search.objective import SUBSET_PREFIX, Goal
from heterog.search.planner import CANDIDATES, plan_graph
from heterog.search.problem import Problem
from heterog.search.synthetic import TableCostModel, layered_graph, toy_cluster

LAYERS = [(1.0, 10, 1.0)] * 12 + [(0.1, 400, 0.01)]  # a CNN-like body and a parameter-heavy head


def _inputs(speeds=(40.0, 10.0, 10.0, 10.0), memory_gib=16.0, batch=64, layers=LAYERS):
    g = layered_graph(layers, batch_size=batch, skip_every=3)
    c = toy_cluster(list(speeds), memory_gib=memory_gib, devices_per_node=2)
    return g, c, TableCostModel(graph=g, cluster=c)


def test_best_is_no_worse_than_any_baseline_and_explained():
    g, c, costs = _inputs()
    # tolerance 0: the fastest candidate, whatever its devices (tests/test_objective.py tries the rest)
    r = plan_graph(g, c, costs, budget_s=3, policy=False, max_iters=400, goal=Goal(tolerance=0.0))
    names = [x.strategy for x in r.candidates]
    fixed = [n for n in names if not n.startswith(SUBSET_PREFIX)]
    assert names[: len(fixed)] == fixed == [n for n in CANDIDATES if n in names]
    assert set(BASELINE_BUILDERS) | {"search"} <= set(names)
    feasible = [x.iteration_time_s for x in r.candidates if x.feasible]
    assert r.best.predicted_iteration_time_s == pytest.approx(min(feasible))
    even = next(x for x in r.candidates if x.strategy == "even-dp-allreduce")
    assert r.best.predicted_iteration_time_s < even.iteration_time_s  # unlike devices: even DP wastes the fast one
    r.best.validate(g, c)
    assert r.best.cluster["name"] == c.name and r.best.priorities
    assert any("faster than even data parallelism" in n for n in r.best.notes)
    doc = r.to_dict()
    assert set(doc) >= {"best", "candidates", "search_time_s", "other_time_s"}
    assert {"strategy", "iteration_time_s", "feasible", "peak_memory_bytes"} <= set(doc["candidates"][0])
    assert Plan.from_dict(json.loads(json.dumps(doc["best"]))).strategy == r.best.strategy


def test_toy_cluster_shares_come_out_four_to_one():
    g, c, costs = _inputs(speeds=(40.0, 10.0), layers=[(1.0, 1, 1.0)] * 8, batch=100)
    r = plan_graph(g, c, costs, budget_s=2, policy=False, max_iters=300)
    dp = [grp for grp in r.best.groups if len(grp.replicas) == 2]
    assert dp, "expected data parallelism on both devices"
    shares = {rep.device: rep.share for rep in dp[0].replicas}
    fast, slow = shares["n0/d0"], shares["n0/d1"]
    assert fast / slow == pytest.approx(4.0, rel=0.1)


def test_model_that_fits_nowhere_names_the_memory_needed():
    g, c, costs = _inputs(memory_gib=1.0, layers=[(1.0, 900, 1.0)] * 4)  # 3.6 GB of weights, 1 GiB GPUs
    with pytest.raises(InfeasibleError) as e:
        plan_graph(g, c, costs, budget_s=1, policy=False, max_iters=100)
    msg = str(e.value)
    assert "fits nowhere" in msg and "GiB" in msg and "smallest need found" in msg


def test_memory_heavy_model_where_even_dp_overflows_but_plan_fits():
    # fast device has little memory: even DP overflows it; the planner finds a plan that fits
    layers = [(0.5, 1, 30.0)] * 8
    g, c, costs = _inputs(speeds=(40.0, 10.0, 10.0, 10.0), memory_gib=[2.0, 16.0, 16.0, 16.0], layers=layers, batch=64)
    r = plan_graph(g, c, costs, budget_s=2, policy=False, max_iters=300)
    byname = {x.strategy: x for x in r.candidates}
    assert not byname["proportional-dp"].feasible
    # (a plan may leave the small device out: it then has no peak)
    assert r.best.predicted_peak_memory_bytes.get("n0/d0", 0) <= c.memory_bytes("n0/d0")


def test_search_is_reproducible_with_a_seed():
    g, c, costs = _inputs()
    prob = Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=64)
    starts = [b(prob) for b in BASELINE_BUILDERS.values()]
    a = Annealer(prob, 7).run(starts, budget_s=60, max_iters=300)
    b = Annealer(prob, 7).run(starts, budget_s=60, max_iters=300)
    assert a.best.key() == b.best.key()
    assert a.best_estimate.iteration_time_s == b.best_estimate.iteration_time_s
    assert a.best_estimate.score <= min(estimate(prob, s).score for s in starts)


def test_plan_cli_json_on_a_zoo_model(tmp_path):
    from typer.testing import CliRunner

    from heterog.cli.main import app

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "32",
            "--cluster",
            "paper-8gpu",
            "--budget-s",
            "2",
            "--json",
            "--out",
            str(out),
            "--no-gnn",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert set(doc) >= {"best", "candidates", "search_time_s", "other_time_s"}
    assert Plan.load(out).strategy == doc["best"]["strategy"]


def test_estimate_agrees_with_the_simulator_on_baselines():
    from heterog.simulate.simulator import simulate

    g, c, costs = _inputs()
    prob = Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=64)
    for name in ("even-dp-allreduce", "proportional-dp", "single-device"):
        s = prob.finalize(BASELINE_BUILDERS[name](prob))
        est = estimate(prob, s)
        sim = simulate(g, c, prob.to_plan(s, name), costs, timeline=False)
        assert est.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=0.1), name
        assert est.feasible == sim.feasible


def test_finds_a_plan_where_every_baseline_runs_out_of_memory():
    # 77 GB of activations at batch 64 on 4 × 16 GiB: no baseline fits but zero-uneven, which
    # accumulates per replica (Cephalo's rule); accumulating gradients over micro-batches (1F1B
    # keeps one in flight per stage) or over each replica's pieces does
    layers = [(0.5, 10, 150.0)] * 8
    g, c, costs = _inputs(speeds=(20.0, 10.0, 10.0, 10.0), memory_gib=16.0, layers=layers, batch=64)
    r = plan_graph(g, c, costs, budget_s=3, policy=False, max_iters=600)
    byname = {x.strategy: x for x in r.candidates}
    assert not any(byname[n].feasible for n in BASELINE_BUILDERS if n != "zero-uneven")
    assert max(x.accumulate for x in byname["zero-uneven"].plan.groups[0].replicas) > 1
    pieces = max(x.accumulate for x in r.best.groups[0].replicas)
    assert r.best.strategy == "search" and (r.best.num_microbatches > 1 or pieces > 1)
    assert all(b <= c.memory_bytes(d) for d, b in r.best.predicted_peak_memory_bytes.items())


def test_planner_is_reproducible_with_a_seed_and_iteration_cap():
    g, c, costs = _inputs()
    runs = [plan_graph(g, c, costs, budget_s=60, seed=3, policy=False, max_iters=200) for _ in range(2)]
    a, b = (r.best for r in runs)
    assert a.strategy == b.strategy and a.groups == b.groups and a.num_microbatches == b.num_microbatches
    assert a.predicted_iteration_time_s == b.predicted_iteration_time_s


def test_plan_strategy_writes_the_named_candidates_plan(tmp_path, capsys):
    """`heterog plan --strategy NAME --out` writes that candidate (here a baseline), so any
    candidate the planner reports can be simulated and run; an unknown name is refused."""
    from typer.testing import CliRunner

    from heterog.cli.main import app
    from heterog.ir.plan import Plan

    args = [
        "plan",
        "--model",
        "toy-cnn",
        "--batch-size",
        "32",
        "--cluster",
        "emulated-4",
        "--budget-s",
        "1",
        "--no-gnn",
        "--max-iters",
        "20",
    ]
    r = CliRunner().invoke(app, [*args, "--strategy", "even-dp-allreduce", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    p = Plan.load(tmp_path / "p.json")
    assert p.strategy == "even-dp-allreduce"
    assert {round(x.share, 6) for g in p.groups for x in g.replicas} == {0.25}
    bad = CliRunner().invoke(app, [*args, "--strategy", "even-dp-allreduc", "--out", str(tmp_path / "q.json")])
    assert bad.exit_code == 2 and not (tmp_path / "q.json").exists()
    from heterog.cli.main import run_cli

    capsys.readouterr()
    assert run_cli([*args, "--strategy", "even-dp-allreduc"]) == 2  # refused before any search
    assert "Did you mean 'even-dp-allreduce'" in capsys.readouterr().err


def test_the_explanations_claims_are_the_simulations():
    """Busy fractions and a pipeline's stage figures in the notes are read from a simulation
    of the chosen plan, never written as boilerplate."""
    from heterog.search import explain
    from heterog.search.lanes import Candidate
    from heterog.search.problem import Problem
    from heterog.simulate.simulator import simulate

    g, c, costs = _inputs()
    r = plan_graph(g, c, costs, budget_s=3, policy=False, max_iters=200)
    pipe = next(x for x in r.candidates if x.strategy == "pipeline")
    sim = simulate(g, c, pipe.plan, costs, timeline=False)
    prob = Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 8), batch_size=64)
    notes = explain.notes(
        prob,
        Candidate(
            strategy="pipeline",
            plan=pipe.plan,
            iteration_time_s=sim.iteration_time_s,
            feasible=True,
            peak_memory_bytes={},
            scored_by="simulator",
        ),
        r.candidates,
    )
    busy = {d: sim.compute_time_s[d] / sim.iteration_time_s for d in pipe.plan.devices()}
    top = max(busy, key=busy.get)
    assert any(f"busiest: {top} at {busy[top] * 100:.0f} %" in n for n in notes), notes
    if pipe.plan.num_microbatches > 1:
        line = next(n for n in notes if "micro-batches per iteration" in n)
        assert "busy" not in line.split("computes")[0] and "%" in line, line
    assert not any("keep the" in n and "busy" in n for n in notes)
