"""The stable Python API (heterog/__init__.py): capture, load_cluster, predict, plan, inputs, lower, simulate,
run, run_many — callable in a fresh interpreter, after their packages are imported, and on what
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
    plan = Plan(strategy="one", model=ModelSpec(name="seq", batch_size=4),
                groups=(Group(name="all", nodes=tuple(n.name for n in graph.nodes),
                              replicas=(Replica(device=cluster.devices[0].name, share=1.0),)),))
    result = heterog.simulate(graph, cluster, plan, build_cost_model(graph, cluster))
    assert result.iteration_time_s > 0 and result.feasible


def test_api_names_resolve_in_a_fresh_interpreter():
    code = ("import heterog; import heterog.capture.zoo, heterog.simulate.simulator; "
            "assert all(callable(getattr(heterog, n)) for n in "
            "['capture','load_cluster','predict','plan','simulate','run']); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
