"""The interpreter's clock work: every instruction is marked with the rank's Clock (a CUDA
event on a GPU) while it runs and the marks are read only after the step, so timing adds no
synchronisation inside it. Each instruction has exactly one span per step carrying its index
and op (ir/run_result.py Span); collectives' runs on the side lane come from the sync
runner's own marks."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from heterog.execute.trace import Span, SpanCategory
from heterog.ir.kinds import Phase
from heterog.lower.program import Collective, Compute, Program, Recv, Send


@dataclass(frozen=True, kw_only=True, slots=True)
class _Mark:
    """One timed piece of a step: an instruction (index) or a collective's run on the lane."""

    name: str
    category: SpanCategory
    start: Any  # Clock marks
    end: Any
    index: int | None = None


class StepTiming:
    """The interpreter's timing methods (a mixin of runtime.Interpreter, which sets these)."""

    clock: Any
    program: Program
    instructions: Sequence[Any]
    sync: Any
    stats: Any
    _marks: list[_Mark]
    tp_marks: list[tuple[Any, Any]]  # tensor-parallel all-reduces inside computes (tp_ops.time_with)

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
        ] + [
            _Mark(name="tp all-reduce", category=SpanCategory.TENSOR_PARALLEL, start=a, end=b, index=None)
            for a, b in self.tp_marks
        ]
        self.tp_marks.clear()
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
