"""Running one block's stages: a compute's input assembled from its pieces (this rank's own
earlier outputs, sliced, or what a receive brought) and entering through a Boundary that cuts
the autograd graph; the stage's forward (with recomputation, autocast and the loss where the
model's output is made); its explicit backward over the outputs that received gradients, the
input gradients sent back piece by piece. A mixin of runtime.Interpreter, which holds the
state named below."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint

from heterog.cut.dataflow import INPUT, Dataflow, Stage
from heterog.errors import PlanError
from heterog.execute.evaluation import eval_forward, take_metrics
from heterog.execute.graph_cut import Boundary, GradientSlot, Sink
from heterog.execute.stage_map import unit_of
from heterog.execute.step_modes import StepMode
from heterog.lower.program import Compute, InputPiece, Program
from heterog.workload import Workload, own_slice


@dataclass(kw_only=True)
class _Call:
    """A forward that ran here: what its backward needs."""

    stage: Stage
    lo: int
    sinks: dict[str, tuple[GradientSlot, torch.Tensor]] = field(default_factory=dict)  # value → its backward
    leaves: list[tuple[str, GradientSlot, tuple[InputPiece, ...]]] = field(default_factory=list)
    loss: torch.Tensor | None = None
    saved: list[torch.Tensor] = field(default_factory=list)  # what autograd saved (memory cap only)


class BlockCalls:
    """Forward and backward of the stages a compute runs (see the module's docstring)."""

    if TYPE_CHECKING:  # set by runtime.Interpreter
        flow: Dataflow
        program: Program
        work: Workload
        mode: StepMode
        rank_device: Any
        precision: Any
        scaler: Any
        memory_cap: Any
        call_stage: Callable[..., Any]
        batch_size: int
        loss_weight: float
        peak_live_bytes: int
        stages_of: dict[int, list[int]]
        _gradient_hooks: list[Any]
        _arrival_bytes: int
        mb_offsets: list[int]
        block_of_group: dict[int, int]
        run_of: list[int]
        range_of: dict[tuple[int, int], tuple[int, int]]
        pieces_of: dict[tuple[int, int], list[InputPiece]]
        _inputs: dict[str, Any]
        _targets: Any
        _anchor: torch.Tensor
        _env: dict[tuple[str, int], Any]
        _slots: dict[tuple[str, int], GradientSlot]
        _calls: dict[tuple[int, int], _Call]
        _inbox: dict[tuple[int, str], torch.Tensor]
        _outbox: dict[tuple[int, str], torch.Tensor]
        _loss_total: Any
        reports_loss: bool

        def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
        def _value(self, v: str, m: int) -> Any: ...
        def _slice(self, local: Any, v: str, start: int, stop: int, held: int) -> torch.Tensor: ...
        def _saving(self, saved: list[torch.Tensor]) -> Any: ...
        def live_bytes(self, also: Any = ...) -> Any: ...

    def _watch_gradients(self) -> None:
        """An emulated device with a memory cap also counts, inside a backward, the moment a
        parameter's new gradient exists beside the one it is about to be added into (a later
        micro-batch's, or an accumulation step's): a transient of the parameter's size that no
        instruction boundary sees and a GPU allocator's peak would. Hooks on the parameters of
        the stages this rank runs (registered once) note the largest such gradient; after the
        backward, what is live then — every gradient held, what the backward saved — plus that
        one is the peak. The hooks only read a size, so the timed backward stays as it was."""
        if self._gradient_hooks:
            return
        seen: set[int] = set()
        for stages in self.stages_of.values():
            for si in stages:
                for param in self.flow.stages[si].module.parameters():
                    if param.requires_grad and id(param) not in seen:
                        seen.add(id(param))
                        self._gradient_hooks.append(param.register_hook(self._arrival_hook(param)))

    def _arrival_hook(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def arrives(grad: torch.Tensor) -> None:
            if param.grad is not None:
                self._arrival_bytes = max(self._arrival_bytes, grad.numel() * grad.element_size())

        return arrives

    def _gather(self, v: str, ins: Compute) -> tuple[Any, tuple[GradientSlot, tuple[InputPiece, ...]] | None]:
        """Samples [ins.lo, ins.hi) of value v for a stage run by `ins`: (value, where its
        gradient lands and the pieces it came in, when it takes a gradient; else None). Values
        from other stages enter through a Boundary: each stage's backward is explicit, and
        their gradients go back piece by piece."""
        owner, m = self.flow.owner[v], unit_of(ins, len(self.mb_offsets) - 1)
        if owner == INPUT:
            lo = self.mb_offsets[ins.microbatch]
            return own_slice(self._inputs[v], lo + ins.lo, lo + ins.hi, self.rank_device.torch_device), None
        a = self.block_of_group[owner]
        if self.run_of[a] == self.run_of[ins.block]:  # same fused run: held here whole
            local = self._value(v, m)
            pieces: tuple[InputPiece, ...] = (InputPiece(block=a, lo=ins.lo, hi=ins.hi, src_lo=ins.lo),)
            parts = [local]
        else:
            pieces = tuple(p for p in self.pieces_of.get((self.run_of[ins.block], m), ()) if p.block == a)
            parts = []
            for p in pieces:
                if p.tag is None:
                    plo, phi = self.range_of[(a, m)]
                    local = self._value(v, m)
                    if len(pieces) == 1 and (plo, phi) == (ins.lo, ins.hi):
                        parts.append(local)
                    else:
                        parts.append(self._slice(local, v, p.lo - plo, p.hi - plo, phi - plo))
                else:
                    parts.append(self._inbox.pop((p.tag, v)))
        if not parts:
            raise PlanError(
                f"value {v!r} reaches block {ins.block} from no piece of the program; "
                f"merge its producer and consumer groups."
            )
        if len(parts) == 1 and not isinstance(parts[0], torch.Tensor):
            return parts[0], None
        x = (parts[0] if len(parts) == 1 else torch.cat([t.detach() for t in parts])).detach()
        if x.is_floating_point():
            slot = GradientSlot(shape=x.shape, dtype=x.dtype, device=x.device)
            return Boundary.apply(self._anchor, x, slot), (slot, pieces)
        return x, None

    def _forward(self, si: int, ins: Compute) -> None:
        s = self.flow.stages[si]
        args, leaves = [], []
        for v in s.args:
            x, grad_in = self._gather(v, ins)
            args.append(x)
            if grad_in is not None:
                leaves.append((v, *grad_in))
        saved: list[torch.Tensor] = []
        if self.mode is StepMode.EVALUATE:  # forward only, the stage's evaluation twin
            out = eval_forward(self, si, args)
        else:
            out = self._train_forward(s, ins, args, saved)
        self._store_forward(si, s, ins, leaves, saved, out)

    def _train_forward(self, s: Stage, ins: Compute, args: list[Any], saved: list[torch.Tensor]) -> Any:
        with self.rank_device.autocast(self.precision), self._saving(saved):  # fp32 master weights
            if self.program.blocks[ins.block].recompute:
                # activation recomputation: keep only the stage's inputs; re-run forward in backward
                out = self._timed(
                    torch.utils.checkpoint.checkpoint, self.call_stage, s.module, *args, use_reentrant=False
                )
            else:
                out = self._timed(self.call_stage, s.module, *args)
        return out

    def _store_forward(
        self, si: int, s: Stage, ins: Compute, leaves: list, saved: list[torch.Tensor], out: Any
    ) -> None:
        """Keep a forward's outputs (and where their gradients go); the loss where the model's
        output is made (in an evaluation step: the loss and the user's metrics, no graph)."""
        m = unit_of(ins, len(self.mb_offsets) - 1)
        self._env[(s.value, m)] = out
        call = _Call(stage=s, lo=ins.lo, leaves=leaves, saved=saved)
        for v in self._values_of(s):
            t = self._value(v, m)
            if isinstance(t, torch.Tensor):
                slot = self._slots[(v, m)] = GradientSlot(shape=t.shape, dtype=t.dtype, device=t.device)
                if t.requires_grad:
                    call.sinks[v] = (slot, Sink.apply(t, slot))
        flow = self.flow
        if flow.projections.get(flow.output, (flow.output,))[0] == s.value:
            y = self._value(flow.output, m)
            lo = self.mb_offsets[ins.microbatch]
            target = own_slice(self._targets, lo + ins.lo, lo + ins.hi, self.rank_device.torch_device)
            if self.mode is StepMode.EVALUATE:
                if self.reports_loss:
                    take_metrics(self, y, target, ins.hi - ins.lo)
                self._calls[(si, m)] = call
                return
            with self.rank_device.autocast(self.precision), self._saving(saved):
                loss = self._timed(self.work.loss, y, target)
            call.loss = loss.float() * ((ins.hi - ins.lo) / self.batch_size * self.loss_weight)
            if self.reports_loss:  # a tensor-parallel member after the first: its set's first reports it
                self._loss_total = self._loss_total + call.loss.detach()  # read once, after the step
            if self.scaler is not None:
                call.loss = self.scaler.scale_loss(call.loss)
        self._calls[(si, m)] = call
        if self.memory_cap is not None:  # the forward's own peak, its outputs and loss beside what it saved
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes(also=[out, call.loss]).total_bytes)

    def _backward(self, si: int, ins: Compute) -> None:
        m = unit_of(ins, len(self.mb_offsets) - 1)
        call = self._calls.pop((si, m))
        s = call.stage
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        if call.loss is not None:
            roots.append(call.loss)
            root_grads.append(None)
        for slot, sink in call.sinks.values():
            if slot.grad is not None:
                roots.append(sink)
                root_grads.append(None)
        if self.memory_cap is not None:
            self._watch_gradients()
            self._arrival_bytes = 0
        if roots:
            self._timed(torch.autograd.backward, roots, root_grads)
        if self.memory_cap is not None:  # the backward's own peak: its gradients beside what it saved
            live = self.live_bytes(also=[call.saved]).total_bytes + self._arrival_bytes
            self.peak_live_bytes = max(self.peak_live_bytes, live)
        for v in self._values_of(s):  # the outputs' gradients are spent
            self._slots.pop((v, m), None)
        for v, slot, pieces in call.leaves:  # input gradients back to their producers
            g = slot.gradient()
            for p in pieces:
                part = g[p.lo - call.lo : p.hi - call.lo]
                if p.tag is None:
                    plo = self.range_of[(p.block, m)][0]
                    self._add_grad(v, m, p.lo - plo, p.hi - plo, part)
                else:
                    assert p.grad_tag is not None, "a received piece sends its gradient back by its grad_tag"
                    self._outbox[(p.grad_tag, v)] = part

    def _values_of(self, s: Stage) -> list[str]:
        return [s.value] + [v for v, (src, _) in self.flow.projections.items() if src == s.value]

    def _add_grad(self, v: str, m: int, lo: int, hi: int, g: torch.Tensor) -> None:
        slot = self._slots[(v, m)]
        if slot.grad is None:
            slot.grad = slot.zeros()
        slot.grad[lo:hi] += g
