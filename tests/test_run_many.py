"""run_many: several plans one after the other in one launch of the rank processes.

Each plan must run as it would alone (`run_many` builds each result as `run` does): the same
losses whatever the plans before it in the same processes did, and a plan that fails must not
hide the others. The plans here also pin the capture's identity-leaf rule (recorder.py):
a zero dropout between two groups on different devices, cut on both sides of it, as GPT-2's
and Llama's even-dp-ps candidates were (one block per group: 'reaches block 3 from no piece
of the program' before the capture attributed the dropout's output to the dropout).
"""

from __future__ import annotations

import math

import pytest

from heterog.capture import capture_model
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
from heterog.runs import run_many

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    """A zero dropout and an identity between two layers, a residual over them."""

    def __init__(self, width=8):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(0.0)
        self.ident = nn.Identity()
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.ident(self.drop(self.inp(x) * 2))
        return self.out(h + self.mid(h))


def factory(width=8):
    return Net(width)


def example_batch(batch_size, seq_len):
    return (torch.randn(batch_size, 4),), torch.randint(0, 3, (batch_size,))


def loss(output, targets):
    return nn.functional.cross_entropy(output, targets)
'''
BATCH = 6


def _plan(name: str, groups: list[tuple[list[str], str]]) -> Plan:
    return Plan(
        strategy=name,
        model=ModelSpec(name=MODEL_NAME, args={"width": 8}, batch_size=BATCH),
        groups=tuple(
            Group(name=f"g{i}", nodes=tuple(nodes), replicas=(Replica(device=d, share=1.0),))
            for i, (nodes, d) in enumerate(groups)
        ),
        cluster={},
    ).validate()


MODEL_NAME = ""


@pytest.fixture()
def plans(tmp_path):
    global MODEL_NAME
    file = tmp_path / "aliasing.py"
    file.write_text(MODEL)
    MODEL_NAME = f"{file}:factory"
    names = [n.name for n in capture_model(MODEL_NAME, {"width": 8}, batch_size=BATCH).nodes]
    assert names[:7] == ["inp", "root::mul@0", "drop", "ident", "mid", "root::add@1", "out"], names
    # the dropout alone on b, what comes before and after it on a: one block per group
    cut = _plan("cut-at-dropout", [(names[:2], "a"), (names[2:3], "b"), (names[3:], "a")])
    fails = _plan("fails-on-b", [(names[:3], "a"), (names[3:], "b")])  # rank 1 dies at step 1
    single = _plan("single", [(names, "a")])
    return cut, fails, single


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plans_run_in_one_launch_as_alone(plans, tmp_path):
    """The single-device plan runs first, again after the cut plan in the same processes
    (the model and its export reused), and after a failing plan in fresh processes: the same
    bits each time; the cut plan matches it within rounding."""
    cut, fails, single = plans
    options = RunOptions(
        steps=2,
        prediction=PredictionConfig(predict=False),
        limits=Limits(timeout_s=60),
        timing=TimingConfig(warmup_steps=0),
        output=OutputConfig(out_dir=tmp_path / "many"),
    )
    outcomes = run_many(
        [single, cut, single, fails, single], options, faults={3: Fault(rank=1, kind=FaultKind.DIE, step=1)}
    )
    assert [o.strategy for o in outcomes] == ["single", "cut-at-dropout", "single", "fails-on-b", "single"]
    for i in (0, 1, 2, 4):
        assert outcomes[i].ok, (i, outcomes[i].failure)
    failure = outcomes[3].failure
    assert failure is not None and outcomes[3].repetitions == ()
    assert "died (exit code 17) at step 1" in failure.message, failure
    assert failure.rank == 1 and "rank 1" in str(outcomes[3].exception) and "device b" in failure.message
    first = outcomes[0].losses
    assert outcomes[2].losses == first and outcomes[4].losses == first
    cut_losses = outcomes[1].losses
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(cut_losses, first)), (cut_losses, first)
    assert outcomes[1].devices == ("a", "b") and outcomes[0].devices == ("a",)
    assert len(outcomes[0].losses) == 2 and outcomes[0].measured_iteration_time_s > 0
