"""Where one stage's autograd graph meets another's, and how long a stage's values live.

The interpreter (runtime.py) runs each stage's backward on its own: a stage input from
another block enters through a `Boundary` whose backward puts the input's gradient in a
`GradientSlot`, and the backward starts from a `Sink` per output, which hands the output the
gradient collected for it. Neither keeps a tensor alive, so a received tensor lives past its
forward only if the stage saved it, and a stage's output only until its last reader here
(`last_reads`) — what the memory model counts (lower/transfers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heterog.cut.dataflow import INPUT, Dataflow
from heterog.execute.stage_map import unit_of
from heterog.ir.kinds import Phase
from heterog.lower.program import Compute, Recv, Send


@dataclass(kw_only=True, slots=True)
class GradientSlot:
    """Where a stage input's gradient lands in backward, and its shape for when none does."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    grad: torch.Tensor | None = None

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def gradient(self) -> torch.Tensor:
        return self.grad if self.grad is not None else self.zeros()


class Boundary(torch.autograd.Function):
    """Identity on a stage input from another block whose backward puts the input's gradient
    in a slot. A leaf tensor would do the same but keep the whole input alive until the
    backward; this keeps nothing (`anchor`, a shared scalar, only makes the output require
    grad)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor, slot: GradientSlot) -> torch.Tensor:
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot = ctx.slot
        slot.grad = grad if slot.grad is None else slot.grad + grad
        return None, None, None


class Sink(torch.autograd.Function):
    """A scalar that depends on a stage output `x`; its backward gives `x` the gradient in
    `slot`. Backward from it instead of from `x` itself: autograd keeps nothing of `x`, so
    the output is freed after its last reader, not at the end of its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slot: GradientSlot) -> torch.Tensor:
        ctx.slot = slot
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return ctx.slot.gradient(), None


def transfer_key(ins: Send | Recv) -> tuple:
    """A forward send's key, which the backward receive of the same move shares."""
    return (ins.src_block, ins.dst_block, ins.microbatch, ins.lo, ins.hi, ins.peer)


def last_reads(
    instructions,
    flow: Dataflow,
    stages_of: dict[int, list[int]],
    first_compute: dict[tuple[int, Phase, int], int],
    crossing: dict[tuple[int, int], list[str]],
    n_microbatches: int,
) -> dict[int, list[tuple[str, int]]]:
    """Instruction index → the values (stage output, unit_of) it is the last to read: a
    stage's outputs are read by the forward that makes them (the loss, the sample count), by
    the forwards of stages that take them here and by the forward sends that carry them."""
    last: dict[tuple[str, int], int] = {}

    def source(v: str) -> str:
        return flow.projections.get(v, (v, 0))[0]

    for index, ins in enumerate(instructions):
        if not isinstance(ins, (Compute, Send)) or ins.phase != Phase.FORWARD:
            continue
        m = unit_of(ins, n_microbatches) if isinstance(ins, Compute) else ins.microbatch
        if isinstance(ins, Compute):
            for si in stages_of.get(ins.block, ()):
                if first_compute[(si, Phase.FORWARD, m)] != index:
                    continue
                s = flow.stages[si]
                last[(s.value, m)] = index
                for v in s.args:
                    if flow.owner[v] != INPUT:
                        last[(source(v), m)] = index
        elif isinstance(ins, Send):
            for v in crossing.get((ins.src_block, ins.dst_block), ()):
                last[(source(v), m)] = index
    out: dict[int, list[tuple[str, int]]] = {}
    for key, index in last.items():
        out.setdefault(index, []).append(key)
    return out
