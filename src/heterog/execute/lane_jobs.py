"""Jobs on a rank's sync lane beside its gradient buckets: a sharded block's reduce-scatters
and all-gathers (shard.py), which install their own results. They run in launch order with
the buckets' collectives (sync.BucketRunner), so every member meets them in the Program's
order, and each is timed as the Program instruction it carries out."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from heterog.ir.kinds import SyncMethod


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A collective on the sync lane (LaneJobs.submit) that installs its own result."""

    label: str
    members: tuple[int, ...]
    method: SyncMethod = SyncMethod.RING
    buffers: tuple[torch.Tensor, ...] = field(default=(), compare=False)  # what it holds (memory count)


class LaneJobs:
    """Submitting jobs to the lane of a sync.BucketRunner (its base), which holds the lane, the
    pending work, the timed runs and the clock."""

    lane: Any
    clock: Any
    _pending: list[tuple[Any, Any, bool]]
    runs: list[tuple[str, Any, Any, int | None]]
    sync_s: float
    _result: Callable[[Any, Any], Any]

    def submit(
        self, label: str, members: tuple[int, ...], index: int | None, fn: Callable[..., Any], *args: Any
    ) -> tuple[Job, Any]:
        """Run fn(*args) on the lane after the collectives launched before it, timed as the
        Program instruction `index`; finish() waits for it. Returns what `wait` takes."""
        t0 = time.perf_counter()
        job = Job(label=label, members=members, buffers=tuple(a for a in args if isinstance(a, torch.Tensor)))
        handle = self.lane.submit(self._timed, label, index, fn, *args)
        self._pending.append((job, handle, True))
        self.sync_s += time.perf_counter() - t0
        return job, handle

    def wait(self, submitted: tuple[Job, Any]) -> Any:
        """Wait for one submitted job (and so for every collective launched before it)."""
        t0 = time.perf_counter()
        out = self._result(*submitted)
        self.sync_s += time.perf_counter() - t0
        return out

    def _timed(self, label: str, index: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        start = self.clock.mark() if self.clock is not None else None
        out = fn(*args)
        if self.clock is not None:
            self.runs.append((label, start, self.clock.mark(), index))
        return out

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers of submitted jobs still running (a reduce-scatter's flat gradients)."""
        return [
            t
            for job, handle, _ in self._pending
            if isinstance(job, Job) and not (isinstance(handle, Future) and handle.done())
            for t in job.buffers
        ]
