"""What one step of the interpreter runs: a training step, an accumulating one (computes and
transfers, the gradients adding up) or an evaluation (forward only), and the figures a step
leaves behind. Apart from the interpreter so that the train loop and evaluation can name the
modes without importing it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from heterog.ir.kinds import CollectiveOp, Phase
from heterog.lower.program import Collective, Optimizer


class StepMode(StrEnum):
    """What one `Interpreter.step` runs of the rank's instructions."""

    TRAIN = "train"  # every instruction, then the optimizer step
    ACCUMULATE = "accumulate"  # computes and transfers only: the gradients add up (--accumulate)
    EVALUATE = "evaluate"  # forward computes and forward transfers only, without autograd


def runs_in(ins: Any, mode: StepMode) -> bool:
    """Whether instruction `ins` runs in a step of `mode`. A stage-3 sharded block's gathers
    (and, accumulating, its per-micro-batch reduce-scatters, which add into its pieces'
    gradients) run with the computes they serve (shard.py); no other collective does."""
    if mode is StepMode.TRAIN:
        return True
    if isinstance(ins, Collective) and ins.phase is not None:
        return mode is StepMode.ACCUMULATE or (ins.primitive is CollectiveOp.ALL_GATHER and ins.phase == Phase.FORWARD)
    if isinstance(ins, (Collective, Optimizer)):
        return False
    return mode is StepMode.ACCUMULATE or ins.phase == Phase.FORWARD


@dataclass(kw_only=True)
class StepStats:
    compute_s: float = 0.0  # measured forward/backward/optimizer time (before pacing)
    cpu_s: float = 0.0  # CPU time of that compute (this thread)
    paced_s: float = 0.0  # waiting added to emulate a slower device
    recv_wait_s: float = 0.0  # receives: how long this rank waited for its peers' tensors
    sync_s: float = 0.0  # collective launches and the wait for their results
    samples: int = 0
