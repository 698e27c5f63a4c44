"""run_many: several plans one after the other in one launch of the rank processes.

Each plan must run as `run` runs it alone: the same result keys, the same losses as the same
model trained on one device, whatever ranks the plans before it used; a plan that fails must
not hide the others. The plans here also pin the capture's identity-leaf rule (recorder.py):
a zero dropout between two groups on different devices, cut on both sides of it, as GPT-2's
and Llama's even-dp-ps candidates were (one block per group: 'reaches block 3 from no piece
of the program' before the capture attributed the dropout's output to the dropout).
"""

from __future__ import annotations

import math

import pytest

from heterog.capture import capture_model
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.pipeline import run, run_many

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
    return Plan(strategy=name, model=ModelSpec(name=MODEL_NAME, args={"width": 8}, batch_size=BATCH),
                groups=tuple(Group(name=f"g{i}", nodes=tuple(nodes), replicas=(Replica(device=d, share=1.0),))
                             for i, (nodes, d) in enumerate(groups)),
                cluster={}).validate()


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
    fails = _plan("fails-on-b", [(names[:3], "a"), (names[3:], "b")])   # rank 1 dies at step 1
    single = _plan("single", [(names, "a")])
    return cut, fails, single


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plans_run_in_one_launch_as_run_runs_them(plans, tmp_path):
    cut, fails, single = plans
    outcomes = run_many([cut, fails, single], steps=2, predict=False, timeout_s=60, warmup_steps=0,
                        out_dir=tmp_path / "many", faults={1: {"rank": 1, "kind": "die", "step": 1}})
    assert [o.strategy for o in outcomes] == ["cut-at-dropout", "fails-on-b", "single"]
    assert outcomes[0].error is None, outcomes[0].error
    assert outcomes[2].error is None, outcomes[2].error   # started afresh after the failure
    assert outcomes[1].result is None and "died (exit code 17) at step 1" in str(outcomes[1].error), \
        outcomes[1].error
    assert "rank 1" in str(outcomes[1].error) and "device b" in str(outcomes[1].error)
    cut_losses, single_losses = outcomes[0].result["losses"], outcomes[2].result["losses"]
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(cut_losses, single_losses)), \
        (cut_losses, single_losses)
    alone = run(single, steps=2, predict=False, timeout_s=60, warmup_steps=0, shape_links=False)
    assert set(alone) == set(outcomes[2].result)
    assert alone["losses"] == single_losses          # the same bits as a launch of its own
    assert outcomes[0].result["devices"] == ["a", "b"] and outcomes[2].result["devices"] == ["a"]
