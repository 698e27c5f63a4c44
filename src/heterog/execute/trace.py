"""Measured events of a run, per rank, as a Chrome trace beside the simulator's.

A rank records spans (name, category, start, end) with a `StepRecorder`; the executor wraps
the parts of a step it wants to see::

    rec = StepRecorder(rank=rank, device=device)
    with rec.span("forward g3 mb0", SpanCategory.FORWARD):
        ...

Times are wall-clock seconds since the epoch (a monotonic clock shifted once to the epoch),
so the ranks of a local run share one time axis without exchanging clocks. Across machines
they are only as aligned as the machines' clocks; each rank's own spans are exact.

Spans (ir/run_result.py Span) that time a Program instruction carry its index and op, so a
span names its instruction as the Program and the simulator do (lower/program.py
instruction_id). `chrome_trace(recordings)` lays the ranks out as the simulator does (SimResult.to_chrome_trace):
one process per device with a compute thread and a communication thread, so the measured and
the simulated trace open side by side in Perfetto and read the same way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from heterog.ir.run_result import COMPUTE_CATEGORIES, Span, SpanCategory

SCHEMA_VERSION = 1
KIND = "heterog.MeasuredTrace"


@dataclass(kw_only=True)
class StepRecorder:
    """One rank's spans. `step` is the step that new spans belong to (set by the step loop)."""

    rank: int
    device: str
    step: int = 0
    spans: list[Span] = field(default_factory=list)
    # perf_counter is monotonic and fine-grained; shift it once so every rank reads epoch time
    _offset_s: float = field(default_factory=lambda: time.time() - time.perf_counter())

    def now_s(self) -> float:
        return time.perf_counter() + self._offset_s

    @contextlib.contextmanager
    def span(self, name: str, category: SpanCategory | str, rank: int | None = None) -> Iterator[None]:
        """Record the time the body takes (also when it raises: a failed step is still seen)."""
        cat = SpanCategory(category)
        start = self.now_s()
        try:
            yield
        finally:
            self.spans.append(
                Span(
                    name=name,
                    category=cat,
                    rank=self.rank if rank is None else rank,
                    step=self.step,
                    start_s=start,
                    end_s=self.now_s(),
                )
            )

    def add(self, spans: Iterable[Span]) -> None:
        """Spans timed elsewhere (the interpreter's, read after the step)."""
        self.spans.extend(spans)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "version": SCHEMA_VERSION,
            "rank": self.rank,
            "device": self.device,
            "spans": [s.to_dict() for s in self.spans],
        }

    def to_chrome_trace(self) -> dict[str, Any]:
        return chrome_trace([RankSpans(rank=self.rank, device=self.device, spans=tuple(self.spans))])


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSpans:
    """What one rank recorded (StepRecorder.to_dict, read back)."""

    rank: int
    device: str
    spans: tuple[Span, ...]

    @staticmethod
    def from_dict(doc: dict[str, Any]) -> RankSpans:
        return RankSpans(
            rank=int(doc["rank"]), device=doc["device"], spans=tuple(Span.from_dict(s) for s in doc["spans"])
        )


def chrome_trace(recordings: Iterable[RankSpans]) -> dict[str, Any]:
    """Chrome trace-event JSON of every rank's spans, times in microseconds from the earliest
    span (the format's unit). Steps go on a thread of their own so they do not hide the
    compute and communication spans inside them."""
    recs = sorted(recordings, key=lambda r: r.rank)
    t0 = min((s.start_s for r in recs for s in r.spans), default=0.0)
    trace: list[dict[str, Any]] = []
    for r in recs:
        pid = r.rank + 1
        trace.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{r.device} (rank {r.rank}, measured)"}}
        )
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": r.rank}})
        for tid, label in ((1, "compute"), (2, "communication"), (3, "steps")):
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
        for s in r.spans:
            tid = 3 if s.category is SpanCategory.STEP else 1 if s.category in COMPUTE_CATEGORIES else 2
            trace.append(
                {
                    "name": s.name,
                    "cat": str(s.category),
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": (s.start_s - t0) * 1e6,
                    "dur": max(s.end_s - s.start_s, 0.0) * 1e6,
                    "args": {"step": s.step, "op": s.op},
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"source": "heterog run (measured)"}}
