"""The global gradient norm of a distributed step, and clipping by it, equal to a single
process's `torch.nn.utils.clip_grad_norm_` over the whole model.

After the gradient syncs every copy of a parameter holds the same gradient, so the norm
counts each parameter once, on one rank (`counted_here`):
- a group's parameters synced by all-reduce, or held by one device: on the lowest rank that
  holds them;
- a tied parameter's copies (summed over their holders): on the lowest holder;
- a group synced by a parameter server: on the server, from the gradient sum it gathered
  (the replicas' own gradients are partial sums). The server's update then waits for the
  norm: the run's syncs are deferred (sync.py), as for fp16's overflow check;
- a sharded block's parameters (shard.py): each member counts its piece, whose gradient
  the reduce-scatter summed; the pieces cut the block's parameters apart, so each element
  is counted once (the model's own gradients there are partial sums, or freed);
- parameters no forward reads have no gradient, as in one process.
Each rank adds the squares of what it counts; one all-reduce over all ranks sums them (with
the step's loss, for the metrics); the square root is the global norm. Clipping multiplies
every gradient the optimizers step — each rank's local ones and pieces, each server's sums — by
max_norm / (norm + 1e-6) when that is below 1, torch's coefficient
(torch/nn/utils/clip_grad.py `clip_grads_with_norm_`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from heterog.ir.kinds import SyncMethod
from heterog.lower.program import Collective


def counted_here(sync) -> tuple[set[str], list[tuple[str, ...]]]:
    """(names of this rank's parameters whose gradient it counts, the names of the server
    buckets it serves) under a ProgramSync's Program (module docstring)."""

    program, flow, rank, rank_of = sync.program, sync.flow, sync.rank, sync.rank_of
    block_of = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
    served_blocks = {
        ins.block
        for instructions in program.instructions.values()
        for ins in instructions
        if isinstance(ins, Collective) and not ins.tie and SyncMethod(ins.method) is SyncMethod.PS
    }
    served = [s.names for s in sync.served()]
    mine: set[str] = set()
    for g, names in flow.param_names.items():
        block = program.blocks[block_of[g]]
        holders = [rank_of[d] for d in block.devices]
        for name in names:
            if name in flow.unused:
                continue
            if name in flow.tied:
                holders_of_tie = {rank_of[d] for tg in flow.tied[name] for d in program.blocks[block_of[tg]].devices}
                if min(holders_of_tie) == rank:
                    mine.add(name)
            elif block_of[g] in served_blocks:
                continue  # counted on the server, from its sum
            elif block.shard_stage:
                continue  # counted piece by piece, on each member (GradientNorm)
            elif min(holders) == rank:
                mine.add(name)
    return mine, served


@dataclass(frozen=True, kw_only=True, slots=True)
class StepNorm:
    """What the end of a step learned from all ranks together."""

    norm: float  # the global gradient norm (before clipping)
    loss: float  # the step's loss, summed over the ranks' shares


class GradientNorm:
    """This rank's part of the global gradient norm, and clipping (module docstring)."""

    def __init__(
        self,
        sync,
        named: Sequence[tuple[str, nn.Parameter]],
        device: torch.device,
        host_staging: bool,
        *,
        only: set[str] | None = None,
    ):
        names, self.served = counted_here(sync)
        if only is not None:  # a tensor-parallel member after the first: its slices alone
            names &= only
        pieces, sharded = sync.shards.pieces(), sync.shards.sharded_names()  # its sharded blocks'
        self.counted = [p for n, p in named if n in names] + sync.shards.pieces(only)
        self.params = [p for n, p in named if n not in sharded] + pieces  # what the optimizer steps
        self.runner = sync.runner
        self.device, self.host_staging = device, host_staging

    def _server_sums(self) -> list[torch.Tensor]:
        """The gradient sums this rank's servers gathered this step (deferred syncs)."""
        out = []
        for names in self.served:
            buf = self.runner.servers[names].buffer
            if buf is not None:
                out.append(buf)
        return out

    def reduce(self, loss: float) -> StepNorm:
        """Sum the squares of what this rank counts, and its loss, over every rank."""
        tensors = [p.grad for p in self.counted if p.grad is not None] + self._server_sums()
        squares = sum((torch.linalg.vector_norm(t.float()) ** 2 for t in tensors), torch.zeros((), device=self.device))
        both = torch.stack([squares.to(torch.float64), torch.tensor(loss, dtype=torch.float64, device=self.device)])
        if self.host_staging:  # gloo between ranks sharing a GPU: reduce on the host
            both = both.to("cpu")
        if dist.is_initialized():
            dist.all_reduce(both)
        return StepNorm(norm=float(both[0].sqrt()), loss=float(both[1]))

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale every gradient this rank will step with (its own, its pieces, its servers' sums)."""
        coef = max_norm / (norm + 1e-6)
        if coef >= 1.0:
            return
        tensors = [p.grad for p in self.params if p.grad is not None] + self._server_sums()
        if tensors:
            torch._foreach_mul_(tensors, coef)
