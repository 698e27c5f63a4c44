"""Emulating unlike devices on one machine: compute pacing, core pinning, shaped links.

Compute: an emulated device with slowdown k runs each piece of compute for real and
measures the CPU time its thread spent on it, then waits until k × that CPU time has
passed since the piece started (pacing: on 2 cores, thread counts were measured not to give
clean speed ratios, pacing does). Pacing on CPU time rather than wall time makes a device's
speed independent of the other processes sharing the cores (other ranks, other users):
time a rank spends descheduled is absorbed by its wait, as long as the contention stays
below its slowdown. A device with slowdown 1 never waits, so it runs at whatever speed the
shared CPU gives it. Pinning ranks to cores (os.sched_setaffinity) is optional and coarse.

Memory: a cpu device of an emulated cluster that declares `memory_gib` (or `memory_bytes`)
gets that capacity enforced at run time, as a GPU would: after every instruction its rank
counts the bytes its live tensors hold (parameters, gradients, optimizer state, and the
activations: values the Program keeps, received tensors, gradients in flight and what
autograd saved for backward), each storage once, and stops with MemoryCapExceeded when
they pass the cap. The planner respects the same capacity through the memory model; this
makes a plan that ignores it (an even data-parallel baseline on a small device) fail for
real instead of running in the machine's ample RAM.

Memory reuse: a GPU's caching allocator keeps freed blocks for the next step; glibc's malloc
instead returns every block above its mmap threshold (at most 32 MiB) to the kernel on free
and takes fresh, zeroed pages on the next allocation. Measured on this 2-core VM (a GPT-2 of
the run-vs-sim scenarios, one thread, training steps in a loop): at batch 16 a third of the
step's CPU time was page faults (631 ms per step, 207 ms of it in the kernel, 65 000 faults;
with freed memory kept: 422 ms, no faults), the fault cost varied from step to step with the
host's load, and it made the step non-linear in the batch (the logits cross 32 MiB between
batch 8 and 11). So rank processes and the profile keep freed memory (`keep_freed_memory`,
`KEEP_FREED_MEMORY_ENV`): no mmap for large blocks, no trimming of the heap — the CPU
analogue of a caching allocator.

Links: see netns.py (namespaces, veth pairs, tc TBF), used when running as root.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from heterog.errors import ResourceError
from heterog.hardware.spec import cluster_from_dict

MIB = 2**20

# glibc reads these at process start (mallopt(3)): large blocks from the heap, never trimmed
KEEP_FREED_MEMORY_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**62),
    "MALLOC_TOP_PAD_": str(64 * MIB),
}
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # mallopt's parameter numbers (malloc.h)


def keep_freed_memory() -> bool:
    """Have this process's malloc keep freed memory for reuse, as KEEP_FREED_MEMORY_ENV does
    for a process started with it (module docstring); True when the C library is glibc and
    took the settings, False elsewhere (nothing changes)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 * MIB))
    )


class Pacer:
    """Stretches measured compute by a slowdown factor (1.0: no waiting)."""

    def __init__(self, slowdown: float = 1.0):
        if not slowdown >= 1.0:
            raise ValueError(
                f"slowdown must be ≥ 1 (a device cannot run faster than this CPU when emulated), found {slowdown}."
            )
        self.slowdown = slowdown

    def pace(self, wall_s: float, cpu_s: float) -> float:
        """A piece of compute took `wall_s` and used `cpu_s` of this thread's CPU: wait until
        slowdown × cpu_s has passed since it started; returns the time it waited."""
        extra = self.slowdown * cpu_s - wall_s
        if extra <= 0:
            return 0.0
        start = time.perf_counter()
        deadline = start + extra
        time.sleep(extra)
        while time.perf_counter() < deadline:  # sleep may return early
            time.sleep(deadline - time.perf_counter())
        return time.perf_counter() - start  # as waited: a sleep also overshoots


def pin_to_cores(rank: int, cores: list[int] | None = None) -> list[int]:
    """Pin this process to one core, round-robin by rank over `cores` (default: all allowed)."""
    allowed = sorted(cores if cores else os.sched_getaffinity(0))
    core = allowed[rank % len(allowed)]
    os.sched_setaffinity(0, {core})
    return [core]


class MemoryCapExceeded(ResourceError):
    """An emulated device's live tensors passed the memory it declares (a GPU's out-of-memory)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveBytes:
    """Bytes a rank's live tensors hold at one moment, by kind (each storage counted once)."""

    parameters_bytes: int = 0
    gradients_bytes: int = 0
    optimizer_state_bytes: int = 0
    activations_bytes: int = 0
    buffers_bytes: int = 0  # the gradient sync's kept buffers (receive buffers, a server's sum)

    @property
    def total_bytes(self) -> int:
        return (
            self.parameters_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.activations_bytes
            + self.buffers_bytes
        )


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a value as the interpreter holds it: a tensor, or tuples, lists and
    dicts of them (a Hugging Face ModelOutput is a dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


class StorageCounter:
    """Sums the bytes of tensors' storages, each storage once (views and tensors that
    autograd saved but that are also kept as values share storage)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self._seen:
                self._seen.add(key)
                total += nbytes
        return total


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCap:
    """The capacity an emulated device declares; `check` raises when live tensors exceed it."""

    device: str
    cap_bytes: int

    def check(self, live: LiveBytes, *, index: int, what: str) -> None:
        if live.total_bytes <= self.cap_bytes:
            return
        raise MemoryCapExceeded(
            f"device {self.device} exceeded its emulated memory cap of {self.cap_bytes / MIB:.0f} MiB at "
            f"instruction {index} ({what}): live tensors hold {live.total_bytes / MIB:.1f} MiB (parameters "
            f"{live.parameters_bytes / MIB:.1f}, gradients {live.gradients_bytes / MIB:.1f}, optimizer state "
            f"{live.optimizer_state_bytes / MIB:.1f}, activations {live.activations_bytes / MIB:.1f}, sync buffers "
            f"{live.buffers_bytes / MIB:.1f} MiB). "
            f"The plan puts more on {self.device} than it holds: use a plan from `heterog plan` for this "
            f"cluster (it keeps every device within its memory) or raise memory_gib of {self.device} in "
            f"the cluster YAML."
        )


def memory_cap(cluster_doc: dict[str, Any] | None, device: str) -> MemoryCap | None:
    """The cap of `device` when the plan's cluster is emulated and the device declares its
    memory (memory_gib / memory_bytes in the YAML); None otherwise (nothing is enforced)."""
    if not cluster_doc or cluster_doc.get("kind") != "emulated":
        return None
    dev = cluster_from_dict(cluster_doc).device(device)
    return MemoryCap(device=device, cap_bytes=int(dev.memory_bytes)) if dev.memory_bytes is not None else None
