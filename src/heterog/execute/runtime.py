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
from typing import Any

import torch
import torch.utils.checkpoint

from heterog.cut.dataflow import Dataflow
from heterog.errors import PlanError
from heterog.execute.block_calls import BlockCalls, _Call
from heterog.execute.device import LossScaler, RankDevice
from heterog.execute.emulation import LiveBytes, MemoryCap, Pacer, StorageCounter, tensors_in
from heterog.execute.graph_cut import GradientSlot, last_reads, transfer_key
from heterog.execute.shard import ShardRunner
from heterog.execute.stage_map import crossing_values, stages_of_blocks, unit_of
from heterog.execute.step_modes import StepMode, StepStats, runs_in
from heterog.execute.step_timing import StepTiming, _Mark
from heterog.execute.trace import SpanCategory
from heterog.execute.transport import Transport
from heterog.ir.kinds import Phase, Precision
from heterog.lower.program import Collective, Compute, InputPiece, Optimizer, Program, Recv, Send
from heterog.workload import Workload


class Interpreter(StepTiming, BlockCalls):
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
        self._gradient_hooks: list[Any] = []  # memory cap: gradient arrivals counted (block_calls.py)
        self._arrival_bytes = 0  # the largest gradient that arrived beside a held one, this backward
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
        self.reports_loss = True  # False on tensor-parallel members after the first (same loss)
        self.eval_sums: dict[str, float] = {}  # evaluation: metric × samples, summed here
        self.eval_modules: dict[int, Any] = {}  # stage → its forward-only twin (evaluation.py)
        self.evaluate_fn: Callable[[Any, Any], Any] | None = None
        self.overflow_hook: Callable[[], None] | None = None  # test hook: an inf into a gradient
        self.clock = self.rank_device.clock()
        self._marks: list[_Mark] = []
        self.tp_marks: list[tuple[Any, Any]] = []  # tensor parallelism: tp_ops.time_with fills it
        self._optimizer_index: int | None = None  # fp16: the Optimizer instruction, stepped at the end
        self.trace: list[tuple] = []
        self.samples: list[int] = []  # per forward compute: samples in the tensors it produced
        self._anchor = torch.zeros((), requires_grad=True, device=self.rank_device.torch_device)  # Boundary's
        self.block_of_group = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
        self.stages_of, self.first_compute, self.run_of = stages_of_blocks(program, flow, self.instructions)
        if shards is not None:
            shards.check_stages(self.stages_of)
        self.crossing = crossing if crossing is not None else crossing_values(program, flow)
        self.n_microbatches = len(program.microbatch_sizes)
        self.range_of, self.pieces_of = self._own_ranges()
        offsets = [0]
        for n in program.microbatch_sizes:
            offsets.append(offsets[-1] + n)
        self.mb_offsets = offsets
        self.drop_after = last_reads(
            self.instructions, flow, self.stages_of, self.first_compute, self.crossing, self.n_microbatches
        )

    # -- helpers --------------------------------------------------------------------------
    def _own_ranges(self) -> tuple[dict[tuple[int, int], tuple[int, int]], dict[tuple[int, int], list[InputPiece]]]:
        """(block, unit) → the samples its forward here computes; (run, unit) → its input
        pieces. Keyed by unit_of: the micro-batch, or a later piece of a replica that accumulates."""
        range_of: dict[tuple[int, int], tuple[int, int]] = {}
        pieces_of: dict[tuple[int, int], list[InputPiece]] = {}
        for ins in self.instructions:
            if isinstance(ins, Compute) and ins.phase == Phase.FORWARD:
                unit = unit_of(ins, self.n_microbatches)
                range_of[(ins.block, unit)] = (ins.lo, ins.hi)
                pieces_of.setdefault((self.run_of[ins.block], unit), []).extend(ins.inputs)
        return range_of, pieces_of

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
        unit = unit_of(ins, self.n_microbatches)
        for si in stages if ins.phase == Phase.FORWARD else reversed(stages):
            if self.first_compute[(si, ins.phase, unit)] != index:
                continue  # this stage ran at an earlier block of its fused run
            if ins.phase == Phase.FORWARD:
                self._forward(si, ins)
                out = self._env[(self.flow.stages[si].value, unit)]
                first = out[0] if isinstance(out, (tuple, list)) else out
                counted = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else -1
            else:
                self._backward(si, ins)
        if ins.phase == Phase.FORWARD and self.stages_of.get(ins.block):
            self.samples.append(counted)
        if ins.phase == Phase.BACKWARD:
            self._free(unit)

    def _free(self, m: int) -> None:
        """Drop a micro-batch's (a piece's: unit_of) values once none of its forwards awaits a
        backward here."""
        if not any(k[1] == m for k in self._calls):
            for key in [k for k in self._env if k[1] == m]:
                del self._env[key]

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
