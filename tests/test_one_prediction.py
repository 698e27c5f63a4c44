"""One prediction per plan: `heterog plan`, `simulate`, `report` and `run` print the same
predicted iteration time for the same plan and cluster, on an emulated cluster and on a GPU
cluster (run emulated), because they build the plan's inputs through one function
(heterog/inputs.py) with one device model."""

from __future__ import annotations

import json

import pytest

from heterog.cli.main import run_cli

TWO_CPUS = """
name: two-cpus
kind: emulated
nodes:
  - name: n
    nic_bandwidth_gbps: 10
    devices: [{type: cpu, name: n/fast, slowdown: 2}, {type: cpu, name: n/slow, slowdown: 4}]
"""
TWO_GPUS = """
name: two-gpus
nodes:
  - name: a
    nic_bandwidth_gbps: 25
    devices: [{type: V100-32GB, count: 1}]
  - name: b
    nic_bandwidth_gbps: 25
    devices: [{type: T4, count: 1}]
"""


def _json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    capsys.readouterr()
    assert run_cli([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("yaml", "model", "batch", "emulated"),
    [(TWO_CPUS, "toy-cnn", 32, []), (TWO_GPUS, "toy-cnn", 1024, ["--emulated"])],
    ids=["emulated-cluster", "gpu-cluster"],
)
def test_plan_simulate_report_and_run_print_the_same_predicted_time(
    yaml, model, batch, emulated, tmp_path, capsys, monkeypatch
):
    import torch

    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)  # as a fresh `heterog plan` process starts; the cpu type must not follow it
    (tmp_path / "cluster.yaml").write_text(yaml)
    planned = _json(
        capsys,
        "plan",
        "--model",
        model,
        "--batch-size",
        str(batch),
        "--cluster",
        "cluster.yaml",
        "--budget-s",
        "2",
        "--max-iters",
        "20",
        "--no-gnn",
        "--tolerance",
        "0",  # the fastest plan, a real split; a tolerance may prefer one device
        "--out",
        "plan.json",
    )
    predicted = planned["best"]["predicted_iteration_time_s"]
    assert len({r[0] for g in planned["best"]["groups"] for r in g["replicas"]}) == 2  # both devices: a real split
    torch.set_num_threads(2)
    assert _json(capsys, "simulate", "plan.json")["iteration_time_s"] == pytest.approx(predicted, rel=1e-12)
    torch.set_num_threads(2)
    assert _json(capsys, "report", "plan.json", "--out", "r.html")["iteration_time_s"] == pytest.approx(
        predicted, rel=1e-12
    )
    ran = _json(capsys, "run", "plan.json", "--steps", "2", *emulated)
    assert ran["predicted_iteration_time_s"] == pytest.approx(predicted, rel=1e-12)


def test_predicting_leaves_the_callers_thread_count_alone(tmp_path):
    """The `cpu` devices of an emulated cluster are costed at one thread (their ranks run one)
    without setting this process's thread count: the type records the count of its rates,
    and the costs computed from it later use that probe."""
    import torch

    import heterog
    from heterog.hardware.spec import parse_cluster_yaml
    from heterog.inputs import device_view

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cluster = parse_cluster_yaml(TWO_CPUS, "<test>")
        assert device_view(cluster).gpu_types["cpu"].cpu_threads == 1 and torch.get_num_threads() == 2
        result = heterog.plan("mlp", batch_size=8, cluster=cluster, budget_s=1, max_iters=5, policy=False)
        at_two = heterog.simulate(result).iteration_time_s
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert heterog.simulate(result).iteration_time_s == at_two == result["best"]["predicted_iteration_time_s"]
    finally:
        torch.set_num_threads(before)
