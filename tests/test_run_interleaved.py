"""run_interleaved: plans of one emulated cluster measured side by side in one launch.

Each device has one process for the whole launch (so a node's namespace and shaped link stay
its own across plans), a plan's rank runs in the process of its device, rounds alternate
their order (A B C, C B A), and a plan that fails is reported once and not run again while
the others go on. Every round of a plan must train as the plan does alone: the same losses.
"""

from __future__ import annotations

import json
import math

import pytest

from heterog.capture import capture_model
from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import (
    Fault,
    FaultKind,
    Limits,
    OutputConfig,
    PredictionConfig,
    RunOptions,
    TimingConfig,
)
from heterog.runs import run_interleaved

MODEL = """
import torch
from torch import nn


def factory(width=8):
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


def example_batch(batch_size, seq_len):
    return (torch.randn(batch_size, 4),), torch.randint(0, 3, (batch_size,))


def loss(output, targets):
    return nn.functional.cross_entropy(output, targets)
"""
CLUSTER = """
name: two-nodes
kind: emulated
nodes:
  - name: a
    nic_bandwidth_gbps: 1
    devices: [{type: cpu, name: a/c0}, {type: cpu, name: a/c1}]
  - name: b
    nic_bandwidth_gbps: 1
    devices: [{type: cpu, name: b/c0}]
"""
BATCH = 6


@pytest.fixture()
def plans(tmp_path):
    file = tmp_path / "net.py"
    file.write_text(MODEL)
    model = f"{file}:factory"
    names = [n.name for n in capture_model(model, {"width": 8}, batch_size=BATCH).nodes]
    cluster = parse_cluster_yaml(CLUSTER, "<test>")

    def plan(name: str, groups: list[tuple[list[str], str]]) -> Plan:
        return Plan(
            strategy=name,
            model=ModelSpec(name=model, args={"width": 8}, batch_size=BATCH),
            groups=tuple(
                Group(name=f"g{i}", nodes=tuple(nodes), replicas=(Replica(device=d, share=1.0),))
                for i, (nodes, d) in enumerate(groups)
            ),
            cluster=cluster_to_dict(cluster),
            cluster_fingerprint=cluster.fingerprint(),
        ).validate()

    single = plan("single", [(names, "a/c1")])  # process 1 only
    split = plan("split", [(names[:2], "a/c0"), (names[2:], "b/c0")])  # processes 0 and 2, across b's link
    fails = plan("fails", [(names[:2], "a/c0"), (names[2:], "b/c0")])
    return single, split, fails


def _first_span_s(folder) -> float:
    return min(s["start_s"] for s in json.loads((folder / "trace_rank0.json").read_text())["spans"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plans_measured_side_by_side_in_one_launch(plans, tmp_path):
    single, split, fails = plans
    out = tmp_path / "inter"
    options = RunOptions(
        steps=2,
        timing=TimingConfig(warmup_steps=0, repetitions=2),
        prediction=PredictionConfig(predict=False),
        limits=Limits(timeout_s=60),
        output=OutputConfig(out_dir=out),
    )
    got = run_interleaved([single, split, fails], options, faults={2: Fault(rank=1, kind=FaultKind.DIE, step=1)})
    assert [g.strategy for g in got] == ["single", "split", "fails"]
    assert got[0].ok and got[1].ok
    assert len(got[0].repetitions) == 2 and len(got[1].repetitions) == 2
    # the failing plan: named once, its second round not started
    failure = got[2].failure
    assert got[2].repetitions == () and failure is not None
    assert "died (exit code 17) at step 1" in failure.message and "device b/c0" in failure.message
    assert not (out / "rep1" / "plan2").exists()
    # each round trains as the plan alone: same losses round to round, and split equals single
    first = got[0].repetitions[0].losses
    assert got[0].repetitions[1].losses == first
    for rep in got[1].repetitions:
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(rep.losses, first)), (rep.losses, first)
    # ranks run in their devices' processes
    assert [r.device for r in got[0].repetitions[0].per_rank] == ["a/c1"]
    assert [r.device for r in got[1].repetitions[0].per_rank] == ["a/c0", "b/c0"]
    # rounds alternate their order: single before split, then split before single
    assert _first_span_s(out / "rep0" / "plan0") < _first_span_s(out / "rep0" / "plan1")
    assert _first_span_s(out / "rep1" / "plan1") < _first_span_s(out / "rep1" / "plan0")
    shaping = got[1].link_shaping
    import os

    if os.geteuid() == 0:  # as root the two nodes' link is shaped for the whole launch
        assert shaping.enabled, shaping
    else:
        assert not shaping.enabled and shaping.reason
