"""One rank's training step: the interpreter of this rank's Program instructions.

The executor decides nothing. The Program (heterog.lower) lists, for this rank, in order:
computes of a block's forward or backward on a sample range of a micro-batch, sends and
receives of a block's outputs or of their gradients, gradient collectives and the optimizer
step. This module runs them one after another with torch:

- a block runs the model's stages (partition.py) whose groups lie in it. A stage spanning
  several blocks of one fused run (blocks cut only for gradient buckets, which exchange
  nothing with other devices in between) runs at the first of their computes in the program;
- a compute's input is assembled from the pieces its instruction names: this rank's own
  earlier outputs (sliced) or tensors a receive brought. Pieces from other blocks enter
  through a boundary (`Boundary`, graph_cut.py) that cuts the autograd graph, so a block's backward is one
  explicit `torch.autograd.backward` over its outputs that received gradients; the input
  gradients the boundaries catch go back as the program's backward sends say. The boundary
  holds nothing of its input: a received tensor lives past its forward only if the stage
  saved it for backward, as the memory model (lower/transfers.py) counts it. Likewise a
  stage's outputs are kept only until their last reader here (a compute or a send) has run:
  the backward starts from a `Sink` that takes the outputs' gradients from a slot, so it
  needs no output tensor;
- collectives start asynchronously (sync.py) when the program reaches them and are waited
  for at the optimizer step;
- transfers go through the Transport (transport.py): each Send and Recv moves the values
  that cross between its blocks, shaped by the wire table, posted in the sender's order;
- every instruction is timed with the rank's Clock (a CUDA event on a GPU), and the spans
  are read after the step (`read_timings`), so timing adds no synchronisation inside it.
  Each instruction has exactly one span per step carrying its index and op (ir/run_result.py
  Span): a compute its forward or backward, a send its posting, a receive its wait, a
  collective its run on the lane (the launch is the executor's own), the optimizer
  instruction its step (the wait for the syncs before it is the executor's own).

Exactness: the loss of a replica's samples is mean-reduced by the zoo entry, so it is scaled
by samples / global batch; the sum over replicas and micro-batches is the global-batch mean.
`trace` records what really ran (block, phase, micro-batch, samples; peers and tags; members)
so tests can hold it against the Program.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.utils.checkpoint

from heterog.cut.dataflow import INPUT, Dataflow, Stage
from heterog.errors import PlanError
from heterog.execute.device import LossScaler, RankDevice
from heterog.execute.emulation import LiveBytes, MemoryCap, Pacer, StorageCounter, tensors_in
from heterog.execute.graph_cut import Boundary, GradientSlot, Sink, last_reads, transfer_key
from heterog.execute.shard import ShardRunner
from heterog.execute.trace import Span, SpanCategory
from heterog.execute.transport import MAX_VALUES, Transport
from heterog.ir.kinds import CollectiveOp, Phase, Precision
from heterog.lower.program import Collective, Compute, InputPiece, Optimizer, Program, Recv, Send
from heterog.workload import Workload, slice_batch


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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Mark:
    """One timed piece of a step: an instruction (index) or a collective's run on the lane."""

    name: str
    category: SpanCategory
    start: Any  # Clock marks
    end: Any
    index: int | None = None


@dataclass(kw_only=True)
class _Call:
    """A forward that ran here: what its backward needs."""

    stage: Stage
    lo: int
    sinks: dict[str, tuple[GradientSlot, torch.Tensor]] = field(default_factory=dict)  # value → its backward
    leaves: list[tuple[str, GradientSlot, tuple[InputPiece, ...]]] = field(default_factory=list)
    loss: torch.Tensor | None = None
    saved: list[torch.Tensor] = field(default_factory=list)  # what autograd saved (memory cap only)


class Interpreter:
    """Runs this rank's instructions of a Program, one training step per `step()` call."""

    def __init__(
        self,
        *,
        program: Program,
        device: str,
        flow: Dataflow,
        work: Workload,
        transport: Transport,
        pacer: Pacer,
        sync,
        batch_size: int,
        rank_of: dict[str, int],
        optimizer=None,
        rank_device: RankDevice | None = None,
        precision: str = "fp32",
        memory_cap: MemoryCap | None = None,
        crossing: dict[tuple[int, int], list[str]] | None = None,
        shards: ShardRunner | None = None,
        scheduler: Any = None,
        grad_norm: Any = None,
        max_grad_norm: float | None = None,
    ):
        self.program, self.flow, self.work = program, flow, work
        self.shards = shards  # the sharded blocks' pieces (shard.py); None: nothing sharded here
        self.memory_cap = memory_cap  # an emulated device's capacity, checked after every instruction
        self.peak_live_bytes = 0
        self.instructions = program.instructions[device]
        self.transport, self.pacer, self.sync = transport, pacer, sync
        self.batch_size, self.rank_of = batch_size, rank_of
        self.optimizer = optimizer
        self.rank_device = rank_device or RankDevice(kind="cpu")
        self.precision = precision
        # fp16: one loss scale on every rank; the check after the sync is a collective
        self.scaler = (
            LossScaler(self.rank_device) if precision == Precision.FP16 and self.rank_device.kind != "meta" else None
        )
        # how a stage module is called (heterog check runs it node by node to name a failing node)
        self.call_stage: Callable[..., Any] = _call
        self.stats = StepStats()
        self.skipped_steps = 0  # fp16: steps skipped on an overflow
        # training options (heterog/training.py): the local optimizer's schedule; the global
        # gradient norm (clipping.py), which defers every update to the end of the step
        self.scheduler, self.grad_norm, self.max_grad_norm = scheduler, grad_norm, max_grad_norm
        self.deferred = self.scaler is not None or grad_norm is not None
        self.last_norm: Any = None  # clipping.StepNorm of the last step, when measured
        self.mode = StepMode.TRAIN
        self.loss_weight = 1.0
        self._loss_total: Any = 0.0
        self.eval_sums: dict[str, float] = {}  # evaluation: metric × samples, summed here
        self.eval_modules: dict[int, Any] = {}  # stage → its forward-only twin (evaluation.py)
        self.evaluate_fn: Callable[[Any, Any], Any] | None = None
        self.overflow_hook: Callable[[], None] | None = None  # test hook: an inf into a gradient
        self.clock = self.rank_device.clock()
        self._marks: list[_Mark] = []
        self._optimizer_index: int | None = None  # fp16: the Optimizer instruction, stepped at the end
        self.trace: list[tuple] = []
        self.samples: list[int] = []  # per forward compute: samples in the tensors it produced
        self._anchor = torch.zeros((), requires_grad=True, device=self.rank_device.torch_device)  # Boundary's
        self.block_of_group = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
        self.stages_of, self.first_compute, self.run_of = _stages_of_blocks(program, flow, self.instructions)
        if shards is not None:
            shards.check_stages(self.stages_of)
        self.crossing = crossing if crossing is not None else crossing_values(program, flow)
        self.range_of: dict[tuple[int, int], tuple[int, int]] = {}
        self.pieces_of: dict[tuple[int, int], list[InputPiece]] = {}  # (run, micro-batch) → pieces
        for ins in self.instructions:
            if isinstance(ins, Compute) and ins.phase == Phase.FORWARD:
                self.range_of[(ins.block, ins.microbatch)] = (ins.lo, ins.hi)
                self.pieces_of.setdefault((self.run_of[ins.block], ins.microbatch), []).extend(ins.inputs)
        offsets = [0]
        for n in program.microbatch_sizes:
            offsets.append(offsets[-1] + n)
        self.mb_offsets = offsets
        self.drop_after = last_reads(self.instructions, flow, self.stages_of, self.first_compute, self.crossing)

    # -- helpers --------------------------------------------------------------------------
    def _timed(self, fn, *args, **kwargs):
        """Run compute; pace it on an emulated device (emulation.py: on CPU time). Its time
        is the instruction's span (`_timing`); the CPU time is kept for the pacing figures."""
        if self.pacer.slowdown == 1.0 and self.rank_device.kind != "cpu":
            return fn(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.stats.cpu_s += cpu
        self.stats.paced_s += self.pacer.pace(wall, cpu)
        return out

    def _value(self, v: str, m: int) -> Any:
        if v in self.flow.projections:
            src, idx = self.flow.projections[v]
            return self._env[(src, m)][idx]
        return self._env[(v, m)]

    def _slice(self, local: Any, v: str, start: int, stop: int, held: int) -> torch.Tensor:
        if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.shape[0] != held:
            what = (
                f"a {type(local).__name__}"
                if not isinstance(local, torch.Tensor)
                else f"a tensor of shape {tuple(local.shape)}"
            )
            raise PlanError(
                f"value {v!r} is {what}, not batch-first with {held} samples, yet it "
                f"crosses blocks with different sample ranges; merge its producer and "
                f"consumer groups."
            )
        return local[start:stop]

    # -- one step ---------------------------------------------------------------------------
    def step(
        self,
        inputs: tuple[Any, ...],
        targets: Any,
        *,
        mode: StepMode = StepMode.TRAIN,
        new_step: bool = True,
        loss_weight: float = 1.0,
    ) -> float:
        """Run this rank's instructions once (those of `mode`: runs_in); returns this rank's
        summed loss. Its timings are read afterwards, once the device has finished
        (`read_timings`). Accumulation: ACCUMULATE steps, then a TRAIN step, each with
        `loss_weight` 1/N and all but the first with new_step=False, so the records, the
        loss and the gradients add up over the N batches."""
        self.mode = mode
        self._env: dict[tuple[str, int], Any] = {}
        self._inbox: dict[tuple[int, str], torch.Tensor] = {}
        self._outbox: dict[tuple[int, str], torch.Tensor] = {}
        # per stage output (value, micro-batch): its shape, and the gradient its readers send
        # back, summed there until the stage's backward spends it
        self._slots: dict[tuple[str, int], GradientSlot] = {}
        self._calls: dict[tuple[int, int], _Call] = {}
        self._inputs = dict(zip(self.flow.inputs, inputs))
        self._targets = targets
        self.loss_weight = loss_weight
        if new_step:
            self._loss_total = 0.0
            self._marks, self._optimizer_index = [], None
            self.sync.runner.runs.clear()
            self.stats = StepStats()
            self.trace, self.samples = [], []  # what this step ran
        self.transport.new_step(forward_only=mode is StepMode.EVALUATE)
        for index, ins in enumerate(self.instructions):
            if not runs_in(ins, mode):
                continue
            if isinstance(ins, Optimizer):
                self._optimizer(index)
            elif isinstance(ins, Collective):  # its span is its run on the lane (sync.py)
                with self._timing(f"launch {self._describe(ins)[0]}", SpanCategory.SYNC):
                    self._run(index, ins)
            else:
                name, category = self._describe(ins)
                with self._timing(name, category, index):
                    self._run(index, ins)
            for key in self.drop_after.get(index, ()):
                self._env.pop(key, None)
            if self.memory_cap is not None:
                live = self.live_bytes()
                self.peak_live_bytes = max(self.peak_live_bytes, live.total_bytes)
                self.memory_cap.check(
                    live,
                    index=index,
                    what=type(ins).__name__.lower()
                    + (
                        f" {ins.phase} of block {ins.block}, micro-batch {ins.microbatch}"
                        if isinstance(ins, Compute)
                        else ""
                    ),
                )
        self.transport.wait_all()
        if mode is not StepMode.TRAIN:
            return float(self._loss_total)
        with self._timing("gradient sync (end of step)", SpanCategory.SYNC):
            self.sync.finish()  # a server without a replica has collectives but no optimizer step
        if self.deferred:  # every rank, so that all skip an overflowing step alike
            self._deferred_step()
            if self.shards is not None:  # the updated pieces to every member (shard.py)
                self.shards.launch_deferred()
                self.sync.finish()
        for sched in [self.scheduler, *self.sync.runner.schedulers]:  # once per step, as one process does
            if sched is not None:
                sched.step()
        if self.rank_device.kind == "meta":  # shapes only (heterog check)
            return float("nan")
        return float(self._loss_total)

    @contextlib.contextmanager
    def aside(self):
        """Steps run inside (an evaluation) leave the last training step's records as they were."""
        kept = (self.trace, self.samples, self._marks, self.stats, self._loss_total, self.mode)
        try:
            yield
        finally:
            self.trace, self.samples, self._marks, self.stats, self._loss_total, self.mode = kept

    def _deferred_step(self) -> None:
        """The update once every rank has its synced gradients: fp16 unscales every gradient
        (the servers' sums too) and skips the update on every rank if any overflowed; the
        global gradient norm is summed over the ranks and clips the gradients
        (clipping.py); then the servers and the local optimizer step."""
        params = [p for grp in self.optimizer.param_groups for p in grp["params"]] if self.optimizer else []
        if self.overflow_hook is not None:
            self.overflow_hook()
        ok = True
        with self._timing("loss-scale check and gradient norm", SpanCategory.SYNC):
            if self.scaler is not None:
                ok = self.scaler.unscale_and_check(params, also=self.sync.runner.unscale_and_check_servers)
            if self.grad_norm is not None:
                self.last_norm = self.grad_norm.reduce(float(self._loss_total))
                if ok and self.max_grad_norm is not None:
                    self.grad_norm.clip(self.last_norm.norm, self.max_grad_norm)
            self.sync.runner.pull_deferred(ok)
        with self._timing("optimizer step", SpanCategory.OPTIMIZER, self._optimizer_index):
            if ok and self.optimizer is not None:
                self._timed(self.optimizer.step)
        self.skipped_steps += 0 if ok else 1

    def _timing(self, name: str, category: SpanCategory, index: int | None = None):
        """Mark the start and end of a piece of the step with the rank's clock."""

        @contextlib.contextmanager
        def timed():
            start = self.clock.mark()
            try:
                yield
            finally:
                self._marks.append(_Mark(name=name, category=category, start=start, end=self.clock.mark(), index=index))

        return timed()

    def _describe(self, ins) -> tuple[str, SpanCategory]:
        name = self.program.describe(ins)
        if isinstance(ins, Compute):
            return name, SpanCategory.FORWARD if ins.phase == Phase.FORWARD else SpanCategory.BACKWARD
        if isinstance(ins, (Send, Recv)):
            return name, SpanCategory.TRANSFER
        if isinstance(ins, Collective):
            return name, SpanCategory.SYNC
        raise AssertionError(f"no span for {type(ins).__name__}")

    def read_timings(self, *, rank: int, step: int, origin: Any, origin_s: float) -> list[Span]:
        """After the step (the device synchronised): this step's spans, times as `origin_s`
        plus the clock's seconds since `origin` (a mark taken at the step's start), and the
        step's stats derived from them (`stats`)."""
        runs = [
            _Mark(name=label, category=SpanCategory.COLLECTIVE, start=a, end=b, index=i)
            for label, a, b, i in self.sync.runner.runs
        ]
        spans = [
            Span(
                name=m.name,
                category=m.category,
                rank=rank,
                step=step,
                index=m.index,
                op=None if m.index is None else self.instructions[m.index].op,
                start_s=origin_s + self.clock.seconds(origin, m.start),
                end_s=origin_s + self.clock.seconds(origin, m.end),
            )
            for m in [*self._marks, *runs]
        ]
        total = {c: 0.0 for c in SpanCategory}
        for sp, m in zip(spans, [*self._marks, *runs]):
            if (
                m.category is SpanCategory.TRANSFER
                and m.index is not None
                and not isinstance(self.instructions[m.index], Recv)
            ):
                continue  # a send's posting is the executor's own time
            total[sp.category] += sp.end_s - sp.start_s
        compute = total[SpanCategory.FORWARD] + total[SpanCategory.BACKWARD] + total[SpanCategory.OPTIMIZER]
        self.stats.compute_s = max(compute - self.stats.paced_s, 0.0)
        self.stats.recv_wait_s = total[SpanCategory.TRANSFER]
        self.stats.sync_s = total[SpanCategory.SYNC]
        return spans

    def _run(self, index: int, ins) -> None:
        if isinstance(ins, Compute):
            self._compute(index, ins)
        elif isinstance(ins, Send):
            self._send(ins)
        elif isinstance(ins, Recv):
            self._recv(ins)
        elif isinstance(ins, Collective):
            self.trace.append(("collective", ins.block, str(ins.method), ins.members))
            self.sync.launch(ins, index)

    def _optimizer(self, index: int) -> None:
        """The Optimizer instruction: wait for the syncs (a SYNC span of the executor's own),
        then step: the instruction's span (fp16 and a measured gradient norm step after the
        loss-scale check and clipping at the end of the step instead, under the same
        instruction)."""
        with self._timing("gradient sync wait", SpanCategory.SYNC):
            self.transport.wait_all()
            self.sync.finish()
            self.sync.sum_tied_gradients()  # copies of a tied parameter: one gradient for all
        self.trace.append(("optimizer",))
        if self.deferred:
            self._optimizer_index = index
            return
        with self._timing("optimizer step", SpanCategory.OPTIMIZER, index):
            if self.optimizer is not None:
                self._timed(self.optimizer.step)

    def live_bytes(self, also: Any = ()) -> LiveBytes:
        """What this rank's live tensors hold now, each storage once: parameters, their
        gradients, optimizer state, and activations (values kept, tensors received or to be
        sent, gradients in flight, and what autograd saved for the backwards still to run;
        `also`: more activations, e.g. what the backward under way saved)."""
        count = StorageCounter()
        params = [p for grp in self.optimizer.param_groups for p in grp["params"]] if self.optimizer else []
        state = list(self.optimizer.state.values()) if self.optimizer else []
        servers = self.sync.runner.servers.values()  # a parameter server's copy and optimizer
        params += [s.master for s in servers if s.master is not None]
        state += [v for s in servers if s.optimizer is not None for v in s.optimizer.state.values()]
        held = (
            self._env,
            self._inbox,
            self._outbox,
            [s.grad for s in self._slots.values()],
            self.transport.in_flight(),
            [(c.saved, c.loss) for c in self._calls.values()],
            also,
        )
        sharded = self.shards.model_params() if self.shards is not None else []
        return LiveBytes(
            parameters_bytes=count.add([*params, *sharded, *(self.shards.live_tensors() if self.shards else [])]),
            gradients_bytes=count.add(p.grad for p in [*params, *sharded] if p.grad is not None),
            optimizer_state_bytes=count.add(tensors_in(state)),
            activations_bytes=count.add(tensors_in(held)),
            buffers_bytes=count.add([*self.sync.runner.kept_buffers(), *self.sync.runner.in_flight()]),
        )

    def _saving(self, saved: list[torch.Tensor]):
        """With a memory cap: record what autograd saves for backward, so it is counted."""
        if self.memory_cap is None:
            return contextlib.nullcontext()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _compute(self, index: int, ins: Compute) -> None:
        """A compute, on the parameters gathered for it when its block shards them (stage 3)."""
        if self.shards is None:
            return self._compute_here(index, ins)
        self.shards.materialise(ins.block, ins.phase, ins.microbatch)
        try:
            self._compute_here(index, ins)
        finally:
            self.shards.release(ins.block, ins.phase, ins.microbatch)

    def _compute_here(self, index: int, ins: Compute) -> None:
        self.trace.append(("compute", ins.block, str(ins.phase), ins.microbatch, ins.hi - ins.lo))
        if ins.lo == ins.hi:
            return
        stages = self.stages_of.get(ins.block, ())
        counted = -1
        for si in stages if ins.phase == Phase.FORWARD else reversed(stages):
            if self.first_compute[(si, ins.phase, ins.microbatch)] != index:
                continue  # this stage ran at an earlier block of its fused run
            if ins.phase == Phase.FORWARD:
                self._forward(si, ins)
                out = self._env[(self.flow.stages[si].value, ins.microbatch)]
                first = out[0] if isinstance(out, (tuple, list)) else out
                counted = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else -1
            else:
                self._backward(si, ins)
        if ins.phase == Phase.FORWARD and self.stages_of.get(ins.block):
            self.samples.append(counted)
        if ins.phase == Phase.BACKWARD:
            self._free(ins.microbatch)

    def _free(self, m: int) -> None:
        """Drop a micro-batch's values once none of its forwards awaits a backward here."""
        if not any(k[1] == m for k in self._calls):
            for key in [k for k in self._env if k[1] == m]:
                del self._env[key]

    def _gather(self, v: str, ins: Compute) -> tuple[Any, tuple[GradientSlot, tuple[InputPiece, ...]] | None]:
        """Samples [ins.lo, ins.hi) of value v for a stage run by `ins`: (value, where its
        gradient lands and the pieces it came in, when it takes a gradient; else None). Values
        from other stages enter through a Boundary: each stage's backward is explicit, and
        their gradients go back piece by piece."""
        owner, m = self.flow.owner[v], ins.microbatch
        if owner == INPUT:
            lo = self.mb_offsets[m]
            return slice_batch(self._inputs[v], lo + ins.lo, lo + ins.hi), None
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
            # evaluation.py imports this module's StepMode: imported at use, not at the top
            from heterog.execute.evaluation import eval_forward

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
        m = ins.microbatch
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
            lo = self.mb_offsets[m]
            target = slice_batch(self._targets, lo + ins.lo, lo + ins.hi)
            if self.mode is StepMode.EVALUATE:
                # evaluation.py imports this module's StepMode: imported at use, not at the top
                from heterog.execute.evaluation import take_metrics

                take_metrics(self, y, target, ins.hi - ins.lo)
                self._calls[(si, m)] = call
                return
            with self.rank_device.autocast(self.precision), self._saving(saved):
                loss = self._timed(self.work.loss, y, target)
            call.loss = loss.float() * ((ins.hi - ins.lo) / self.batch_size * self.loss_weight)
            self._loss_total = self._loss_total + call.loss.detach()  # read once, after the step
            if self.scaler is not None:
                call.loss = self.scaler.scale_loss(call.loss)
        self._calls[(si, m)] = call
        if self.memory_cap is not None:  # the forward's own peak, its outputs and loss beside what it saved
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes(also=[out, call.loss]).total_bytes)

    def _backward(self, si: int, ins: Compute) -> None:
        call = self._calls.pop((si, ins.microbatch))
        s, m = call.stage, ins.microbatch
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        if call.loss is not None:
            roots.append(call.loss)
            root_grads.append(None)
        for slot, sink in call.sinks.values():
            if slot.grad is not None:
                roots.append(sink)
                root_grads.append(None)
        if roots:
            self._timed(torch.autograd.backward, roots, root_grads)
        if self.memory_cap is not None:  # the backward's own peak: its gradients beside what it saved
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes(also=[call.saved]).total_bytes)
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

    # -- transfers ----------------------------------------------------------------------------
    def _send(self, ins: Send) -> None:
        self.trace.append(("send", str(ins.phase), ins.tag, ins.peer, ins.hi - ins.lo))
        tensors = []
        for _, v in self.transport.messages(ins):
            if ins.phase == Phase.FORWARD:
                lo, hi = self.range_of[(ins.src_block, ins.microbatch)]
                local = self._value(v, ins.microbatch)
                tensors.append(self._slice(local, v, ins.lo - lo, ins.hi - lo, hi - lo))
            else:
                tensors.append(self._outbox.pop((ins.tag, v)))
        keep = ins.phase == Phase.FORWARD and self.mode is not StepMode.EVALUATE  # until its gradient is back
        self.transport.send(ins, tensors, key=transfer_key(ins) if keep else None)

    def _recv(self, ins: Recv) -> None:
        self.trace.append(("recv", str(ins.phase), ins.tag, ins.peer, ins.hi - ins.lo))
        received = self.transport.recv(ins)
        for (_, v), x in zip(self.transport.messages(ins), received, strict=True):
            if ins.phase == Phase.FORWARD:
                self._inbox[(ins.tag, v)] = x
            else:
                lo = self.range_of[(ins.src_block, ins.microbatch)][0]
                self._add_grad(v, ins.microbatch, ins.lo - lo, ins.hi - lo, x)
        if ins.phase == Phase.BACKWARD:  # the peer has used what this rank sent it forward
            self.transport.release(transfer_key(ins))


def _call(module: torch.nn.Module, *args: Any) -> Any:
    return module(*args)


def _stages_of_blocks(program: Program, flow: Dataflow, instructions):
    """(block → its stages, (stage, phase, micro-batch) → index of the compute that runs it,
    block → its run). A stage may span several blocks only if they are consecutive and share
    one placement (a fused run cut into gradient buckets); it runs at the first of their
    computes in this rank's program, and those blocks form one run."""
    block_of = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
    stages_of: dict[int, list[int]] = {}
    run_of = list(range(len(program.blocks)))
    for si, s in enumerate(flow.stages):
        blocks = sorted({block_of[g] for g in (s.groups or (s.group,))})
        placements = {(program.blocks[b].devices, program.blocks[b].shares) for b in blocks}
        if len(placements) > 1 or blocks != list(range(blocks[0], blocks[-1] + 1)):
            raise PlanError(
                f"stage {s.value!r} of the split model runs groups of blocks {blocks}, which "
                f"are not one run of a single placement; the model cannot be cut as planned."
            )
        for b in blocks:
            stages_of.setdefault(b, []).append(si)
            run_of[b] = run_of[blocks[0]]
    first: dict[tuple[int, Phase, int], int] = {}
    for index, ins in enumerate(instructions):
        if isinstance(ins, Compute):
            for si in stages_of.get(ins.block, ()):
                first.setdefault((si, ins.phase, ins.microbatch), index)
    return stages_of, first, run_of


def crossing_values(program: Program, flow: Dataflow) -> dict[tuple[int, int], list[str]]:
    """(producer block, consumer block) → the values that move between them, in a fixed order
    (the same on every rank: the order of the split's stages and their arguments)."""
    block_of = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
    out: dict[tuple[int, int], list[str]] = {}
    for s in flow.stages:
        consumers = sorted({block_of[g] for g in (s.groups or (s.group,))})
        for v in s.args:
            owner = flow.owner[v]
            if owner == INPUT:
                continue
            a = block_of[owner]
            for b in consumers:
                if a == b:
                    continue
                lst = out.setdefault((a, b), [])
                if v not in lst:
                    if len(lst) >= MAX_VALUES:
                        raise PlanError(
                            f"more than {MAX_VALUES} values cross from block {a} to block "
                            f"{b}; group the model more coarsely."
                        )
                    lst.append(v)
    return out
