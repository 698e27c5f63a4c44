"""Where the loss runs: the group the plan gives the capture's loss node.

The export the executor cuts holds the model, not its loss; the capture records the ops run
after the model returns as loose runs 'loss::<first op>@k' (recorder.py), and a plan may
place them on other devices than the model's output (the balanced baselines do, for a
language model whose loss over a large vocabulary costs as much as a layer). The Program
then sends the output there (a language model's logits), and the simulator times that
transfer; so the executor computes the loss there too, in a stage of its own
(partition._loss_stage), instead of beside the output's producer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from heterog.ir.plan import Plan

LOSS_PREFIX = "loss::"  # capture names of the ops run after the model returns
LOSS_VALUE = "loss_input"  # the loss stage's value: the model's output, where the loss runs


class LossInput(nn.Module):
    """The loss stage's module: it passes the model's output on; the interpreter computes
    the loss on it where this stage runs (runtime.Interpreter._forward)."""

    def forward(self, x: Any) -> Any:
        return x


def loss_group(plan: Plan) -> int | None:
    """The group of the capture's first loss node ('loss::<op>@0'), or None when the plan
    names none (a plan made for another capture)."""
    found = []
    for gi, g in enumerate(plan.groups):
        for name in g.nodes:
            if name.startswith(LOSS_PREFIX):
                k = name.rpartition("@")[2]
                found.append((int(k) if k.isdigit() else 0, gi))
    return min(found)[1] if found else None


def loss_group_apart(plan: Plan, go: Any, output_groups: Sequence[int], output_group: int) -> int | None:
    """The loss node's group when it runs apart from the model's output: in another run of
    the Program's blocks (`go`: assign.GroupOrder), or without a Program on other replicas;
    None when the loss runs with the output (in its stage, as before)."""
    g = loss_group(plan)
    if g is None or g in output_groups:
        return None
    apart = (
        go.block[g] != go.block[output_group]
        if go.block is not None
        else plan.groups[g].replicas != plan.groups[output_group].replicas
    )
    return g if apart else None
