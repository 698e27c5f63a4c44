"""RunResult: what a run of a plan measured, beside what the simulator predicted for the same
schedule — per step, per rank, per instruction — as a versioned artifact.

`heterog run --out RUN.json` writes it, `heterog report PLAN --run RUN.json` reads it, and
`heterog.run`, `run_many` and `run_interleaved` return it; the demo and the benchmarks read
its fields, not string keys. What it holds:
  repetitions   per repetition of the run (one unless asked): its median iteration time over
                the measured steps, the loss of every step, and per rank the median of each
                part of a step (compute, pacing, waits, syncs) with the simulator's figures
                for the same device and the peak memory measured beside the predicted
  step_lines    per step of the last repetition: the global loss and the slowest rank
  instructions  per Program instruction (its id, lower/program.py instruction_id): its
                predicted start and end in the simulated iteration, its measured start and
                end in the step shown (the median one) and its median measured duration
  spans         every span the ranks measured in the last repetition (execute/trace.py),
                each naming its instruction by op where it times one
A failed plan of run_many / run_interleaved is a RunResult with `failure` set and no
repetitions, so a sweep's results are one list of one type.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from heterog.errors import HeterogError
from heterog.ir.kinds import InstructionKind, Phase
from heterog.ir.provenance import Replan, ResumePoint
from heterog.ir.run_request import RunOptions
from heterog.jsonio import Artifact, Record, from_plain

KIND = "heterog.RunResult"
SCHEMA_VERSION = 1


class SpanCategory(StrEnum):
    """What a measured span is; the first four are the simulator's compute kinds."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    COMPUTE = "compute"  # forward and backward of a whole step, not split further
    SYNC = "sync"  # launching gradient syncs and waiting for them to finish
    COLLECTIVE = "collective"  # a gradient sync running on the rank's communication lane
    TRANSFER = "transfer"  # waiting for point-to-point sends / receives
    TENSOR_PARALLEL = "tp"  # a tensor-parallel all-reduce inside a compute (Megatron's f or g)
    STEP = "step"  # a whole training step (the outer span)


COMPUTE_CATEGORIES = frozenset(
    {SpanCategory.FORWARD, SpanCategory.BACKWARD, SpanCategory.OPTIMIZER, SpanCategory.COMPUTE}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Span(Record):
    """A piece of a step one rank measured. `index` and `op` name the Program instruction it
    times (its place in the rank's list, its op): each instruction has exactly one such span
    per step — a compute its forward or backward, a send its posting, a receive its wait, a
    collective its run on the rank's communication lane, the optimizer instruction its step.
    Spans without them are the executor's own (the step, waits for syncs)."""

    name: str
    category: SpanCategory
    rank: int
    step: int
    start_s: float  # wall-clock seconds since the epoch
    end_s: float
    index: int | None = None
    op: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord(Record):
    """What one rank measured in one step, as it ended."""

    step: int
    rank: int
    device: str
    loss: float  # this rank's part of the global-batch mean loss (0 if none)
    step_time_s: float
    compute_s: float = 0.0  # forward, backward and optimizer, before pacing
    cpu_s: float = 0.0  # CPU time of that compute
    paced_s: float = 0.0  # waiting added to emulate a slower device
    recv_wait_s: float = 0.0  # receives: waiting for the peers' tensors
    sync_s: float = 0.0  # collective launches and the waits for them
    loss_scale: float | None = None  # fp16: the scale after the step
    skipped_steps: int = 0  # fp16: steps skipped on an overflow so far
    lr: float | None = None  # the learning rate the step used
    grad_norm: float | None = None  # the global gradient norm before clipping, when measured

    @property
    def other_s(self) -> float:
        """The executor's own time: the step less its timed parts (gradient slots, slicing)."""
        return self.step_time_s - (self.compute_s + self.paced_s + self.recv_wait_s + self.sync_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLine(Record):
    """One step of the whole run: the ranks' records merged."""

    step: int
    loss: float  # global-batch mean loss (the ranks' parts summed)
    step_time_s: float  # the slowest rank's step time: the iteration time
    slowest_rank: int
    slowest_device: str


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSummary(Record):
    """One rank over the measured steps of a repetition: the median of each part of a step,
    its memory, and the simulator's figures for its device."""

    rank: int
    device: str
    slowdown: float
    cores: tuple[int, ...] | None
    groups: tuple[str, ...]
    step_time_s: float
    compute_s: float
    cpu_s: float
    paced_s: float
    recv_wait_s: float
    sync_s: float
    other_s: float
    sent_bytes_total: int
    max_rss_bytes: int
    torch_device: str = "cpu"
    backend: str = "gloo"
    peak_allocated_bytes: int | None = None  # a GPU's allocator peak; a CPU rank's max RSS
    peak_reserved_bytes: int | None = None
    peak_live_bytes: int | None = None  # an emulated device with a memory cap: its live tensors' peak
    memory_cap_bytes: int | None = None
    skipped_steps: int = 0
    predicted_compute_s: float | None = None
    predicted_communication_s: float | None = None
    predicted_peak_memory_bytes: int | None = None

    @property
    def measured_peak_memory_bytes(self) -> int | None:
        """The measured peak that compares with the predicted one: the live tensors under an
        emulated memory cap, else the allocator's peak (on a CPU rank, the process's resident
        set, which also holds torch itself)."""
        return self.peak_live_bytes if self.peak_live_bytes is not None else self.peak_allocated_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Repetition(Record):
    """One repetition of a run: its median iteration time over the measured steps."""

    measured_iteration_time_s: float
    measured_steps: int
    losses: tuple[float, ...]  # every step's global loss, warm-up included
    per_rank: tuple[RankSummary, ...]
    loss_scales: tuple[float, ...] | None = None  # fp16: the scale after each step
    # the training options that ran (training.Recipe.describe: optimizer, hyperparameters,
    # schedule), the learning rate and gradient norm of each step, and every evaluation
    # ({"step", "eval/loss", …}); None / empty for a run without training options
    training: dict[str, Any] | None = None
    learning_rates: tuple[float | None, ...] | None = None
    grad_norms: tuple[float | None, ...] | None = None
    evaluations: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class InstructionTiming(Record):
    """One Program instruction, predicted beside measured, both as the rank's executor times it
    (a compute its forward or backward, a send its posting, a receive its wait, a collective
    its run on the lane, the optimizer instruction its step). Predicted times are read off the
    simulated iteration (from 0; runs/summary.py predicted_spans); measured start and end are
    in the step shown, from its start (the earliest rank's); measured_s is the median duration
    over the measured steps."""

    id: str
    device: str
    rank: int
    index: int
    op: int
    kind: InstructionKind
    phase: Phase | None
    name: str
    predicted_start_s: float | None = None
    predicted_end_s: float | None = None
    measured_start_s: float | None = None
    measured_end_s: float | None = None
    measured_s: float | None = None

    @property
    def label(self) -> str:
        """forward / backward for a compute, else its kind."""
        return str(self.phase) if self.kind is InstructionKind.COMPUTE and self.phase else str(self.kind)

    @property
    def predicted_s(self) -> float | None:
        if self.predicted_start_s is None or self.predicted_end_s is None:
            return None
        return self.predicted_end_s - self.predicted_start_s

    @property
    def miss_s(self) -> float | None:
        """Measured less predicted (positive: slower than predicted)."""
        p = self.predicted_s
        return None if p is None or self.measured_s is None else self.measured_s - p


@dataclass(frozen=True, kw_only=True, slots=True)
class KindComparison(Record):
    """The instructions of one kind (InstructionTiming.label) on one device, summed."""

    device: str
    kind: str
    count: int
    predicted_s: float
    measured_s: float

    @property
    def miss_s(self) -> float:
        return self.measured_s - self.predicted_s


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShapingRecord(Record):
    """Whether the run's links were shaped (netns + veth + tc TBF), or why not."""

    enabled: bool
    reason: str = ""
    method: str = ""
    nic_bandwidth_bytes_per_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFailure(Record):
    """What stopped a plan's run: the error's type and message, and the rank to blame."""

    type: str
    message: str
    rank: int | None = None


class RunFailedError(HeterogError):
    """A run's failure read back from a result (its original exception is not kept there)."""


@dataclass(frozen=True, kw_only=True)
class RunResult(Artifact, Record, kind=KIND, version=SCHEMA_VERSION):
    strategy: str
    model: str
    cluster: str | None
    devices: tuple[str, ...]  # rank r ↔ devices[r]
    options: RunOptions = field(default_factory=RunOptions)
    repetitions: tuple[Repetition, ...] = ()
    predicted_iteration_time_s: float | None = None
    prediction_source: str = "not requested"
    step_lines: tuple[StepLine, ...] = ()
    instructions: tuple[InstructionTiming, ...] = ()
    shown_step: int | None = None  # the step whose measured instruction times are shown
    spans: tuple[Span, ...] = ()
    link_shaping: LinkShapingRecord = field(default_factory=lambda: LinkShapingRecord(enabled=False))
    notes: tuple[str, ...] = ()
    failure: RunFailure | None = None
    resumed_from: ResumePoint | None = None  # the checkpoint this run (its first launch) started from
    replans: tuple[Replan, ...] = ()  # an elastic run's re-plans (runs/elastic.py)
    # the exception itself, for the caller that ran it (not written to the file)
    exception: BaseException | None = field(default=None, compare=False, repr=False, metadata={"json": False})

    # -- what most readers want -------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def repetitions_s(self) -> tuple[float, ...]:
        return tuple(r.measured_iteration_time_s for r in self.repetitions)

    @property
    def measured_iteration_time_s(self) -> float | None:
        """The median of the repetitions' median iteration times."""
        return statistics.median(self.repetitions_s) if self.repetitions else None

    @property
    def spread(self) -> float | None:
        """Slowest repetition over fastest, less one (0 for one repetition)."""
        t = self.repetitions_s
        return max(t) / min(t) - 1.0 if t else None

    @property
    def relative_error(self) -> float | None:
        m, p = self.measured_iteration_time_s, self.predicted_iteration_time_s
        return (m - p) / p if m is not None and p else None

    @property
    def last(self) -> Repetition:
        self.raise_for_failure()
        return self.repetitions[-1]

    @property
    def losses(self) -> tuple[float, ...]:
        return self.last.losses

    @property
    def per_rank(self) -> tuple[RankSummary, ...]:
        return self.last.per_rank

    @property
    def measured_steps(self) -> int:
        return self.last.measured_steps

    @property
    def training(self) -> dict[str, Any] | None:
        return self.last.training

    @property
    def learning_rates(self) -> tuple[float | None, ...] | None:
        return self.last.learning_rates

    @property
    def grad_norms(self) -> tuple[float | None, ...] | None:
        return self.last.grad_norms

    @property
    def evaluations(self) -> tuple[dict[str, Any], ...]:
        return self.last.evaluations

    def provenance(self) -> list[str]:
        """Where the run resumed from, and each re-plan of an elastic run: one line each."""
        resumed = [self.resumed_from.describe()] if self.resumed_from else []
        return resumed + [r.describe() for r in self.replans]

    def raise_for_failure(self) -> None:
        """Raise what stopped the run (its own exception where this process ran it)."""
        if self.failure is None:
            return
        if self.exception is not None:
            raise self.exception
        raise RunFailedError(f"{self.failure.type}: {self.failure.message}")

    # -- the per-instruction comparison -------------------------------------------------------
    def by_kind(self) -> tuple[KindComparison, ...]:
        """Per device and instruction kind, predicted and measured time summed over the
        instructions both sides timed; the largest misses (either way) first."""
        sums: dict[tuple[str, str], list[float]] = {}
        for i in self.instructions:
            if i.predicted_s is None or i.measured_s is None:
                continue
            s = sums.setdefault((i.device, i.label), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += i.predicted_s
            s[2] += i.measured_s
        rows = [
            KindComparison(device=d, kind=k, count=int(n), predicted_s=p, measured_s=m)
            for (d, k), (n, p, m) in sums.items()
        ]
        return tuple(sorted(rows, key=lambda r: (-abs(r.miss_s), r.device, r.kind)))

    def largest_misses(self, n: int = 10) -> tuple[InstructionTiming, ...]:
        """The `n` instructions whose measured time is furthest from the predicted."""
        timed = [i for i in self.instructions if i.miss_s is not None]
        return tuple(sorted(timed, key=lambda i: (-abs(i.miss_s or 0.0), i.id))[:n])

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The record, and the figures derived from it for readers of the JSON (the same keys
        as the properties; not read back)."""
        out = Record.to_dict(self)
        out.update(
            measured_iteration_time_s=self.measured_iteration_time_s,
            repetitions_s=list(self.repetitions_s),
            spread=self.spread,
            relative_error=self.relative_error,
            steps=self.options.steps,
            warmup_steps=self.options.timing.warmup_steps,
            by_kind=[{**k.to_dict(), "miss_s": k.miss_s} for k in self.by_kind()],
        )
        if self.repetitions:
            last = self.repetitions[-1]
            out.update(
                measured_steps=last.measured_steps,
                losses=list(last.losses),
                loss_scales=None if last.loss_scales is None else list(last.loss_scales),
                per_rank=[r.to_dict() for r in last.per_rank],
                training=last.training,
                learning_rates=None if last.learning_rates is None else list(last.learning_rates),
                grad_norms=None if last.grad_norms is None else list(last.grad_norms),
                evaluations=list(last.evaluations),
            )
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<run result>") -> RunResult:
        return from_plain(cls, doc, source)


def combine_repetitions(results: Sequence[RunResult]) -> RunResult:
    """Several runs of one plan as one result: every repetition in order, the prediction of
    the first that has one, the rest (instructions, spans, steps) of the last."""
    assert results, "no runs to combine"
    first = next((r for r in results if r.predicted_iteration_time_s is not None), results[0])
    return replace(
        results[-1],
        repetitions=tuple(rep for r in results for rep in r.repetitions),
        predicted_iteration_time_s=first.predicted_iteration_time_s,
        prediction_source=first.prediction_source,
    )
