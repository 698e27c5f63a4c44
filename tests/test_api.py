"""The stable Python API (heterog/__init__.py): capture, load_cluster, predict, plan, plan_inputs, lower, simulate,
run, run_many, run_interleaved — callable in a fresh interpreter, after their packages are imported, and on what
heterog's own functions return."""

import subprocess
import sys

import torch

import heterog
import heterog.capture.zoo  # noqa: F401 - importing the packages must not shadow the functions
import heterog.simulate.priorities  # noqa: F401
from heterog.ir import OpGraph


def test_capture_and_simulate_stay_callable_after_their_packages_are_imported():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    graph = heterog.capture(model, (torch.randn(4, 8),))
    assert isinstance(graph, OpGraph) and graph.num_parameters == 8 * 16 + 16 + 16 * 2 + 2
    cluster = heterog.load_cluster("paper-8gpu")
    from heterog.cost import build_cost_model
    from heterog.ir import Group, ModelSpec, Plan, Replica

    plan = Plan(
        strategy="one",
        model=ModelSpec(name="seq", batch_size=4),
        groups=(
            Group(
                name="all",
                nodes=tuple(n.name for n in graph.nodes),
                replicas=(Replica(device=cluster.devices[0].name, share=1.0),),
            ),
        ),
    )
    result = heterog.simulate(graph, cluster, plan, build_cost_model(graph, cluster))
    assert result.iteration_time_s > 0 and result.feasible


def test_api_names_resolve_in_a_fresh_interpreter():
    """Every API name is its function (or a callable package) even after every module of
    the package is imported: no submodule shadows a function of the same name."""
    code = (
        "import heterog, importlib, pkgutil, types; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(heterog.__path__, 'heterog.') "
        " if not m.name.startswith(('heterog.cli', 'heterog.execute.worker'))]; "
        "bad = [n for n in heterog.__all__ if not callable(getattr(heterog, n)) or "
        "(isinstance(getattr(heterog, n), types.ModuleType) and n not in heterog._PACKAGES)]; "
        "print('bad', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.stdout.strip() == "bad []", out.stdout + out.stderr[-2000:]


def test_the_api_takes_what_it_returns_in_a_fresh_interpreter(tmp_path):
    """heterog.plan's result, its "best", a Plan and a path all go to lower / simulate / plan_inputs /
    run;
    heterog.lower is callable after heterog.plan imported the lower package."""
    code = """
import heterog, json, sys
from heterog.ir.plan import Plan
result = heterog.plan("mlp", batch_size=16, cluster="paper-8gpu", budget_s=2, max_iters=10, policy=False)
best = result["best"]
assert 'heterog.lower' in sys.modules and callable(heterog.lower)   # the package, imported by the planner
Plan.from_dict(best).save("plan.json")
times = {heterog.simulate(x).iteration_time_s for x in (result, best, Plan.from_dict(best), "plan.json")}
assert times == {best["predicted_iteration_time_s"]}, times
assert heterog.lower(best).plan == heterog.lower("plan.json").plan
graph, cluster, costs = heterog.plan_inputs(best)
assert cluster.name == "paper-8gpu" and graph.batch_size == 16
from heterog.ir.run_request import DeviceLayout
ran = heterog.run(best, steps=2, layout=DeviceLayout(emulated=True))  # the planner's dict, on local processes
assert isinstance(ran, heterog.RunResult) and ran.measured_iteration_time_s > 0
assert ran.predicted_iteration_time_s == best["predicted_iteration_time_s"]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_something_else_is_refused_with_what_a_plan_may_be():
    import pytest

    from heterog.errors import PlanError

    with pytest.raises(PlanError, match="expected a plan"):
        heterog.simulate(42)


def test_an_in_memory_modules_plan_simulates_in_the_interpreter_that_planned_it():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    result = heterog.plan(
        model,
        example_inputs=(torch.randn(16, 8),),
        cluster="paper-8gpu",
        budget_s=2,
        max_iters=10,
        policy=False,
        name="tiny",
    )
    assert heterog.simulate(result).iteration_time_s == result["best"]["predicted_iteration_time_s"]
