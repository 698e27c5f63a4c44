"""`heterog run` / `--torchrun`, launch checks, and the per-node profiler."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from heterog.cli.main import app
from heterog.errors import PlanError
from heterog.hardware.spec import cluster_to_dict, load_cluster, parse_cluster_yaml
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import DeviceLayout
from heterog.orchestrate import rank_devices
from heterog.runs import run
from heterog.runs.layout import emulated_slowdowns

TWO_NODES = """
name: two-nodes
kind: emulated
nodes:
  - name: n0
    nic_bandwidth_gbps: 1
    devices:
      - {type: cpu, name: n0/cpu0}
      - {type: cpu, name: n0/cpu1, slowdown: 2}
  - name: n1
    nic_bandwidth_gbps: 1
    devices:
      - {type: cpu, name: n1/cpu0, slowdown: 3}
"""


def _zoo_mlp_plan(cluster, devices, shares) -> Plan:
    from heterog.capture import capture_model

    graph = capture_model("mlp", None, batch_size=12)
    plan = Plan(
        strategy="hand",
        model=ModelSpec(name="mlp", batch_size=12),
        groups=(
            Group(
                name="all",
                nodes=tuple(n.name for n in graph.nodes),
                sync="ring",
                replicas=tuple(Replica(device=d, share=s) for d, s in zip(devices, shares)),
            ),
        ),
        cluster=cluster_to_dict(cluster),
        cluster_fingerprint=cluster.fingerprint(),
    )
    return plan.validate(graph, cluster)


def test_run_command_reports_measured_and_simulated_times(tmp_path):
    cluster = parse_cluster_yaml(TWO_NODES)
    plan = _zoo_mlp_plan(cluster, ["n0/cpu0", "n0/cpu1"], [2 / 3, 1 / 3])
    plan.save(tmp_path / "plan.json")
    res = CliRunner().invoke(
        app,
        [
            "run",
            str(tmp_path / "plan.json"),
            "--steps",
            "3",
            "--json",
            "--pin-cores",
            "--out",
            str(tmp_path / "result.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out == json.loads((tmp_path / "result.json").read_text())
    assert [r["device"] for r in out["per_rank"]] == ["n0/cpu0", "n0/cpu1"]
    assert [r["slowdown"] for r in out["per_rank"]] == [1.0, 2.0]
    cores = sorted(os.sched_getaffinity(0))
    assert [r["cores"] for r in out["per_rank"]] == [[cores[0]], [cores[1 % len(cores)]]]
    assert out["measured_iteration_time_s"] > 0 and out["measured_steps"] == 2
    assert out["prediction_source"] == "simulator", out["prediction_source"]
    assert out["predicted_iteration_time_s"] > 0
    assert out["losses"][0] > 0
    for r in out["per_rank"]:  # the step's parts, as waited, fit inside it; the rest is the executor's own
        assert -1e-4 <= r["other_s"] < r["step_time_s"], r


def test_torchrun_prints_one_command_per_node(tmp_path):
    cluster = parse_cluster_yaml(TWO_NODES)
    plan = _zoo_mlp_plan(cluster, ["n0/cpu0", "n0/cpu1", "n1/cpu0"], [0.5, 0.3, 0.2])
    plan.save(tmp_path / "plan.json")
    res = CliRunner().invoke(
        app, ["run", str(tmp_path / "plan.json"), "--torchrun", "--json", "--master-addr", "10.0.0.1"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["commands"]) == 2
    assert "--nproc-per-node=2" in out["commands"][0] and "--node-rank=1" in out["commands"][1]
    spec = json.loads((tmp_path / "plan.torchrun.json").read_text())
    assert spec["node_devices"] == [["n0/cpu0", "n0/cpu1"], ["n1/cpu0"]]


def test_real_gpu_cluster_needs_emulated_or_torchrun():
    cluster = load_cluster("paper-8gpu")
    devs = [d.name for d in cluster.devices[:2]]
    plan = Plan(
        strategy="t",
        model=ModelSpec(name="mlp", batch_size=8),
        cluster=cluster_to_dict(cluster),
        groups=(
            Group(name="all", nodes=("0",), sync="ring", replicas=tuple(Replica(device=d, share=0.5) for d in devs)),
        ),
    )
    with pytest.raises(PlanError, match="--emulated"):
        run(plan, steps=1)
    # emulated: the fastest device runs at this CPU's speed, the others slower by peak FLOP/s
    slow = emulated_slowdowns(plan, cluster, rank_devices(plan, cluster), emulated=True)
    assert min(slow.values()) == 1.0 and all(v >= 1.0 for v in slow.values())


def test_too_many_ranks_for_one_machine_is_a_clear_error():
    cluster = load_cluster("mixed-64")
    devs = [d.name for d in cluster.devices[:20]]
    plan = Plan(
        strategy="t",
        model=ModelSpec(name="mlp", batch_size=40),
        cluster=cluster_to_dict(cluster),
        groups=(
            Group(name="all", nodes=("0",), sync="ring", replicas=tuple(Replica(device=d, share=1 / 20) for d in devs)),
        ),
    )
    with pytest.raises(PlanError, match="at most 16"):
        run(plan, steps=1, layout=DeviceLayout(emulated=True))


def test_profiler_times_every_leaf_module_at_two_batches():
    from heterog.profile.measure import measure_profile
    from heterog.workload import resolve_workload

    work = resolve_workload(ModelSpec(name="tests/test_execute_models.py:resmlp", batch_size=8))
    prof = measure_profile(work, batch_sizes=(4, 16), repeats=2)
    assert set(prof.times) == {"inp", "block.0", "block.1", "out"}
    for node, by_type in prof.times.items():
        for phase in ("fwd", "bwd"):
            pts = by_type["cpu"][phase]
            assert [b for b, _ in pts] == [4.0, 16.0] and all(t > 0 for _, t in pts), (node, phase)


def test_torchrun_puts_each_rank_on_the_gpu_its_plan_names(tmp_path):
    """A node of 8 GPUs whose plan leaves gpu4 out: the command exposes exactly gpu0-3 and
    gpu5-7, in order, so local rank 4 is the plan's gpu5 (not the node's fifth GPU), and the
    spec names each rank's GPU type for the rank to check."""
    cluster = parse_cluster_yaml(
        "name: box8\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n    devices: [{type: A100-80GB, count: 8}]\n"
    )
    used = [d.name for i, d in enumerate(cluster.devices) if i != 4]
    plan = _zoo_mlp_plan(cluster, used, [1 / 7] * 7)
    plan.save(tmp_path / "plan.json")
    res = CliRunner().invoke(app, ["run", str(tmp_path / "plan.json"), "--torchrun", "--json"])
    assert res.exit_code == 0, res.output
    (command,) = json.loads(res.output)["commands"]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,5,6,7 " in command and "--nproc-per-node=7" in command, command
    spec = json.loads((tmp_path / "plan.torchrun.json").read_text())
    assert spec["node_devices"] == [used] and spec["cuda"]
    assert spec["gpu_types"] == {d: "A100-80GB" for d in used}
