"""SimResult: what one simulated iteration predicts, as JSON and as a Chrome trace."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

SCHEMA_VERSION = 1
KIND = "heterog.SimResult"


class SimEvent(NamedTuple):
    """One piece of the simulated timeline: a task on a device's track or on a link's
    ('link:<link name>'). `op` is the schedule task it times: in the unmerged schedule that a
    Program is written from, the op of the device's instruction (lower/program.py
    instruction_id), so a Program instruction's predicted start and end are the event of its op
    on its device's track."""

    name: str
    category: str
    track: str
    start_s: float
    end_s: float
    op: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """What moved over the cluster in one iteration (SimResult builds it on first use)."""

    communication_time_s: dict[str, float] = field(default_factory=dict)
    link_bytes: dict[str, float] = field(default_factory=dict)
    link_busy_time_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    iteration_time_s: float
    throughput_samples_per_s: float
    batch_size: int
    feasible: bool  # every device's peak fits its memory
    peak_memory_bytes: dict[str, int]
    memory_capacity_bytes: dict[str, int]
    persistent_memory_bytes: dict[str, int]
    overflow_device: str | None = None  # the first device (in time) to run out
    overflow_bytes: int = 0  # its peak minus its memory
    compute_time_s: dict[str, float] = field(default_factory=dict)
    idle_time_s: dict[str, float] = field(default_factory=dict)  # compute queue empty
    num_tasks: int = 0
    memory_timeline: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # the timeline as a tuple of events, and the traffic (Traffic), or functions that build
    # them: the search simulates thousands of plans and reads neither, so both are built on
    # first use
    timeline_source: Any = field(default=(), repr=False, compare=False)
    traffic_source: Any = field(default=None, repr=False, compare=False)
    _built: list = field(default_factory=list, repr=False, compare=False)
    _traffic: list = field(default_factory=list, repr=False, compare=False)

    @property
    def communication_time_s(self) -> dict[str, float]:
        """Per device, the time of the transfers and collectives it takes part in (may overlap
        compute)."""
        return self._traffic_of().communication_time_s

    @property
    def link_bytes(self) -> dict[str, float]:
        return self._traffic_of().link_bytes

    @property
    def link_busy_time_s(self) -> dict[str, float]:
        return self._traffic_of().link_busy_time_s

    def _traffic_of(self) -> Traffic:
        if not self._traffic:
            src = self.traffic_source
            self._traffic.append(src() if callable(src) else (src or Traffic()))
        return self._traffic[0]

    @property
    def events(self) -> tuple[SimEvent, ...]:
        """Timeline events (name, category, track, start_s, end_s, op); track is a device name
        or 'link:<link name>'."""
        if not self._built:
            src = self.timeline_source
            self._built.append(tuple(src() if callable(src) else src))
        return self._built[0]

    def to_dict(self, *, events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration_time_s": self.iteration_time_s,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "batch_size": self.batch_size,
            "feasible": self.feasible,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "persistent_memory_bytes": self.persistent_memory_bytes,
            "overflow_device": self.overflow_device,
            "overflow_bytes": self.overflow_bytes,
            "devices": {
                d: {
                    "compute_time_s": self.compute_time_s[d],
                    "communication_time_s": self.communication_time_s[d],
                    "idle_time_s": self.idle_time_s[d],
                    "peak_memory_bytes": self.peak_memory_bytes[d],
                    "memory_capacity_bytes": self.memory_capacity_bytes[d],
                }
                for d in self.peak_memory_bytes
            },
            "link_bytes": self.link_bytes,
            "link_busy_time_s": self.link_busy_time_s,
            "num_tasks": self.num_tasks,
        }
        if events:
            out["events"] = [
                {"name": n, "category": c, "track": tr, "start_s": s, "end_s": e, "op": op}
                for n, c, tr, s, e, op in self.events
            ]
        return out

    def to_json(self) -> str:
        return json.dumps({"kind": KIND, "version": SCHEMA_VERSION, **self.to_dict(events=True)})

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one process per device
        with a compute and a communication thread and a memory counter, and one process
        holding a thread per link. Times in microseconds, as the format requires."""
        trace: list[dict[str, Any]] = []
        pids: dict[str, int] = {}
        for i, d in enumerate(self.peak_memory_bytes):
            pids[d] = i + 1
            trace.append({"ph": "M", "name": "process_name", "pid": i + 1, "args": {"name": d}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": i + 1, "args": {"sort_index": i}})
            trace.append({"ph": "M", "name": "thread_name", "pid": i + 1, "tid": 1, "args": {"name": "compute"}})
            trace.append({"ph": "M", "name": "thread_name", "pid": i + 1, "tid": 2, "args": {"name": "communication"}})
        link_pid = len(pids) + 1
        trace.append({"ph": "M", "name": "process_name", "pid": link_pid, "args": {"name": "links"}})
        link_tids: dict[str, int] = {}
        for name, cat, track, s, e, op in self.events:
            ev = {"name": name, "cat": cat, "ph": "X", "ts": s * 1e6, "dur": max(e - s, 0.0) * 1e6, "args": {"op": op}}
            if track.startswith("link:"):
                link = track[5:]
                tid = link_tids.get(link)
                if tid is None:
                    tid = link_tids[link] = len(link_tids) + 1
                    trace.append(
                        {"ph": "M", "name": "thread_name", "pid": link_pid, "tid": tid, "args": {"name": link}}
                    )
                ev.update(pid=link_pid, tid=tid)
            else:
                ev.update(pid=pids[track], tid=1 if cat in ("forward", "backward", "optimizer") else 2)
            trace.append(ev)
        for d, points in self.memory_timeline.items():
            for t, b in points:
                trace.append({"ph": "C", "name": "memory", "pid": pids[d], "ts": t * 1e6, "args": {"GiB": b / 2**30}})
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {"iteration_time_s": self.iteration_time_s, "feasible": self.feasible},
        }
