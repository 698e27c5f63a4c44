"""Gradient collectives as the Program says: one bucket per replicated block.

Each replica's loss is already scaled by its share of the global batch (runtime.py), so the
*sum* of the replicas' gradients is the global-batch gradient; every method sums. A Collective
instruction names the block (its parameters are the bucket), the members in ring order, the
method and the server. `launch` starts it asynchronously when the program reaches it (during
backward, so it overlaps the rest of backward), `finish` waits for all of them in launch order
and installs the summed gradients. The method's own code path is in collectives.py when it
exists there; a server that holds no replica of the block contributes zeros.

Process groups: `new_group` is collective over the default group, so every rank creates every
member set's group, in the same order (the program's, identical on every rank).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from heterog.errors import RankError
from heterog.execute.partition import Dataflow
from heterog.ir.kinds import SyncMethod
from heterog.lower.program import Collective, Program


def member_sets(program: Program) -> list[tuple[str, ...]]:
    """Every collective's participants (members and server), in program order, once each."""
    seen: dict[tuple[str, ...], None] = {}
    for d in program.devices:
        for ins in program.instructions[d]:
            if isinstance(ins, Collective):
                seen.setdefault(_participants(ins), None)
    return list(seen)


def _participants(ins: Collective) -> tuple[str, ...]:
    extra = (ins.server,) if ins.server and ins.server not in ins.members else ()
    return tuple(sorted(ins.members + extra))


class BucketSync:
    """This rank's side of the program's gradient collectives."""

    def __init__(self, program: Program, flow: Dataflow, rank_of: dict[str, int], rank: int, timeout_s: float,
                 device: torch.device | None = None):
        self.program, self.flow, self.rank_of, self.rank = program, flow, rank_of, rank
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s
        self.sync_s = 0.0
        self._groups = {key: dist.new_group(ranks=sorted(rank_of[d] for d in key),
                                            timeout=timedelta(seconds=timeout_s))
                        for key in member_sets(program)}
        self._pending: list[tuple[Collective, list[torch.nn.Parameter], torch.Tensor, object]] = []

    def _params(self, block: int) -> list[torch.nn.Parameter]:
        return [p for g in self.program.blocks[block].groups for _, p in self.flow.params_of_group.get(g, [])]

    def _numel(self, block: int) -> int:
        return sum(sum(self.flow.param_numels.get(g, [])) for g in self.program.blocks[block].groups)

    def launch(self, ins: Collective) -> None:
        t0 = time.perf_counter()
        held = ins.server is None or self.program.devices[self.rank] in ins.members
        params = self._params(ins.block) if held else []
        if params and any(p.numel() for p in params):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        else:     # a parameter server without a replica: the bucket's size, zeros in
            params = []
            flat = torch.zeros(self._numel(ins.block), device=self.device)
        self._guard(ins, lambda: self._pending.append((ins, params, flat, self._start(ins, flat))))
        self.sync_s += time.perf_counter() - t0

    def _start(self, ins: Collective, flat: torch.Tensor):
        pg = self._groups[_participants(ins)]
        if ins.method == SyncMethod.PS:
            return dist.reduce(flat, dst=self.rank_of[ins.server], op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg, async_op=True)

    def finish(self) -> None:
        """Wait for every launched collective (in launch order) and install the gradients."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for ins, params, flat, work in pending:
            self._guard(ins, lambda: self._complete(ins, params, flat, work))
        self.sync_s += time.perf_counter() - t0

    def _complete(self, ins: Collective, params, flat: torch.Tensor, work) -> None:
        work.wait(timedelta(seconds=self.timeout_s))
        if ins.method == SyncMethod.PS:   # the server's sum back to every member
            dist.broadcast(flat, src=self.rank_of[ins.server], group=self._groups[_participants(ins)])
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def _guard(self, ins: Collective, fn) -> None:
        try:
            fn()
        except RuntimeError as e:
            raise RankError(self.rank, f"gradient sync of block {self.program.blocks[ins.block].label!r} "
                                       f"({ins.method} over {list(ins.members)}) failed or timed out after "
                                       f"{self.timeout_s:.0f} s ({str(e).splitlines()[0]}).") from None
