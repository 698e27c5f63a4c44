"""Emulating unlike devices on one machine: compute pacing, core pinning, shaped links.

Compute: an emulated device with slowdown k runs each piece of compute for real and
measures the CPU time its thread spent on it, then waits until k × that CPU time has
passed since the piece started (pacing; TOOLCHAIN.md: thread counts do not give clean
ratios on 2 cores, pacing does). Pacing on CPU time rather than wall time makes a device's
speed independent of the other processes sharing the cores (other ranks, other users):
time a rank spends descheduled is absorbed by its wait, as long as the contention stays
below its slowdown. A device with slowdown 1 never waits, so it runs at whatever speed the
shared CPU gives it. Pinning ranks to cores (os.sched_setaffinity) is optional and coarse.

Links: see netns.py (namespaces, veth pairs, tc TBF), used when running as root.
"""

from __future__ import annotations

import os
import time


class Pacer:
    """Stretches measured compute by a slowdown factor (1.0: no waiting)."""

    def __init__(self, slowdown: float = 1.0):
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be ≥ 1 (a device cannot run faster than this CPU "
                             f"when emulated), found {slowdown}.")
        self.slowdown = slowdown

    def pace(self, wall_s: float, cpu_s: float) -> float:
        """A piece of compute took `wall_s` and used `cpu_s` of this thread's CPU: wait until
        slowdown × cpu_s has passed since it started; returns the wait."""
        extra = self.slowdown * cpu_s - wall_s
        if extra <= 0:
            return 0.0
        deadline = time.perf_counter() + extra
        time.sleep(extra)
        while time.perf_counter() < deadline:  # sleep may return early
            time.sleep(deadline - time.perf_counter())
        return extra


def pin_to_cores(rank: int, cores: list[int] | None = None) -> list[int]:
    """Pin this process to one core, round-robin by rank over `cores` (default: all allowed)."""
    allowed = sorted(cores if cores else os.sched_getaffinity(0))
    core = allowed[rank % len(allowed)]
    os.sched_setaffinity(0, {core})
    return [core]
