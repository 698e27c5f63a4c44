"""The `cpu` device type of this machine, measured: a probe of about a second (matmuls,
convolutions, copies, memory-bound kinds forward and backward, tiny ops under autograd),
cached in the user's cache folder per CPU model, torch thread count and torch version, so
an emulated cluster's `cpu` devices have this machine's rates (hardware/catalog.py serves
the type by name)."""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import psutil

from heterog.cachedir import cache_dir as user_cache_dir
from heterog.hardware.gputype import GpuType
from heterog.jsonio import write_atomic

CPU_TYPE = "cpu"
_PROBE_VERSION = 9

# -- the `cpu` device type, measured -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuProbe:
    """Rates of this machine's CPU at one torch thread count (its key says which)."""

    key: str  # cpu model | threads | torch version
    matmul_flops_per_s: dict[int, float]  # square fp32 size n → achieved FLOP/s
    bf16_matmul_flops_per_s: float
    conv_flops_per_s: float  # 3×3 and 1×1 convolutions, forward (geometric mean)
    copy_bandwidth_bytes_per_s: float  # bytes read + written per second
    # achieved bytes (inputs + outputs) per second of memory-bound kinds, by OpGraph kind:
    # CPU batch norm, pooling and softmax run far below copy bandwidth
    kind_bandwidth_bytes_per_s: dict[str, float]
    fresh_page_s_per_byte: float  # first touch of newly mapped memory (page faults)
    # forward time per output element of ops whose cost is neither FLOPs nor bytes on a CPU:
    # dropout's random numbers, GELU's erf (by module type, see cost.roofline)
    element_s: dict[str, float]
    dispatch_s: float  # one small op with autograd recording
    backward_dispatch_s: float  # one small op's backward in the autograd engine
    memory_bytes: int

    @property
    def peak_flops_per_s(self) -> float:
        return max(self.matmul_flops_per_s.values())


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe_key(threads: int) -> str:
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch

    return f"{_cpu_model_name()}|threads={threads}|torch={torch.__version__}|v{_PROBE_VERSION}"


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` for the body; the caller's after it."""
    # torch only to set the count for a measurement: the catalog loads without it
    import torch

    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def cache_dir() -> Path:
    return user_cache_dir()


def _best_time_s(fn, *, repeats: int, min_time_s: float = 0.0) -> float:
    """The fastest of `repeats` runs: on a shared machine the least-disturbed run is the
    closest to the device's own speed (HeteroG profiled the same way: min of 5 runs)."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch

    # One torch thread: its own CPU time, which other processes on a shared machine do not
    # inflate. Several threads: wall time (the fastest run is the least disturbed).
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up (allocations, one-time kernel selection)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time_s:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) > 50 * repeats:
            break
    return min(times)


def _run_probe() -> CpuProbe:
    """About one second of matmuls, a convolution, a copy and tiny ops under autograd."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch

    act = torch.randn(8, 64, 80, 80)  # activation-sized (12.5 MiB)
    src = torch.randn(16 * 2**20 // 4 * 4)  # 64 MiB: larger than any last-level cache here
    with torch.no_grad():
        mm, bf16, conv = _compute_rates()
        copy, kinds, fresh_page = _memory_rates(act, src)
        elements = _element_times(act)
    kinds.update(_backward_rates(act))
    fwd_s, bwd_s = _dispatch_times()
    return CpuProbe(
        key=_probe_key(torch.get_num_threads()),
        matmul_flops_per_s=mm,
        bf16_matmul_flops_per_s=bf16,
        conv_flops_per_s=conv,
        copy_bandwidth_bytes_per_s=copy,
        kind_bandwidth_bytes_per_s=kinds,
        fresh_page_s_per_byte=fresh_page,
        element_s=elements,
        dispatch_s=fwd_s,
        backward_dispatch_s=bwd_s,
        memory_bytes=int(psutil.virtual_memory().total),
    )


def _compute_rates() -> tuple[dict[int, float], float, float]:
    """FLOP/s of square fp32 matmuls by size, of a bf16 matmul, and of convolutions."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch
    import torch.nn.functional as F

    mm: dict[int, float] = {}
    for n in (64, 128, 256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        t = _best_time_s(functools.partial(torch.mm, a, b), repeats=5 if n >= 512 else 20)
        mm[n] = 2 * n**3 / t
    a16, b16 = torch.randn(512, 512).bfloat16(), torch.randn(512, 512).bfloat16()
    bf16 = 2 * 512**3 / _best_time_s(lambda: torch.mm(a16, b16), repeats=3)
    x, w = torch.randn(8, 64, 32, 32), torch.randn(64, 64, 3, 3)
    conv3 = 2 * 8 * 64 * 32 * 32 * 64 * 9 / _best_time_s(lambda: F.conv2d(x, w, padding=1), repeats=5)
    x1, w1 = torch.randn(8, 256, 32, 32), torch.randn(64, 256, 1, 1)
    conv1 = 2 * 8 * 64 * 32 * 32 * 256 / _best_time_s(lambda: F.conv2d(x1, w1), repeats=5)
    # oneDNN runs 3×3 convolutions with Winograd-like tricks, 1×1 as plain GEMMs: the
    # graph does not say which a node is, so the geometric mean stands for both
    return mm, bf16, (conv3 * conv1) ** 0.5


def _memory_rates(act: Any, src: Any) -> tuple[float, dict[str, float], float]:
    """A copy's bytes per second; the memory-bound kinds' (inputs + outputs, max-pool indices
    included, as the capture counts them); and a fresh page's cost per byte."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch
    import torch.nn.functional as F

    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / _best_time_s(lambda: dst.copy_(src), repeats=5)
    nb = act.numel() * 4
    rm, rv = torch.zeros(64), torch.ones(64)
    kinds = {
        "norm": 2 * nb / _best_time_s(lambda: F.batch_norm(act, rm, rv, training=True), repeats=3),
        "pool": (nb + nb / 4 * 3)
        / _best_time_s(lambda: F.max_pool2d_with_indices(act, (3, 3), (2, 2), (1, 1)), repeats=3),
        "elementwise": 2 * nb / _best_time_s(lambda: F.relu(act), repeats=3),
        "attention": 2 * nb / _best_time_s(lambda: torch.softmax(act, dim=-1), repeats=3),
    }
    # the optimizer's element-wise updates stream parameter-sized tensors from memory
    c = torch.randn_like(src)
    kinds["optimizer"] = 4 * src.numel() * 4 / _best_time_s(lambda: dst.addcmul_(src, c, value=0.1), repeats=3)
    # glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh pages
    # every time; the kernel's page faults and zeroing cost far more than the writes
    fill_s = _best_time_s(lambda: dst.fill_(1.0), repeats=3)
    fresh_s = _best_time_s(lambda: torch.empty_like(src).fill_(1.0), repeats=3)
    return copy, kinds, max(fresh_s - fill_s, 0.0) / (src.numel() * 4)


def _element_times(act: Any) -> dict[str, float]:
    """Seconds per output element of ops that cost neither FLOPs nor bytes here."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch.nn.functional as F

    return {
        "dropout": _best_time_s(lambda: F.dropout(act, 0.1, training=True), repeats=3) / act.numel(),
        "gelu": _best_time_s(lambda: F.gelu(act), repeats=3) / act.numel(),
    }


def _backward_rates(act: Any) -> dict[str, float]:
    """Backward of the memory-bound kinds: input gradient from output gradient (+ saved tensors)."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch
    import torch.nn.functional as F

    nb = act.numel() * 4
    rm, rv = torch.zeros(64), torch.ones(64)
    x = act.clone().requires_grad_()
    kinds = {}
    for kind, fn, nbytes in (
        ("norm", lambda t: F.batch_norm(t, rm, rv, training=True), 3 * nb),
        ("pool", lambda t: F.max_pool2d(t, 3, 2, 1), nb * 1.75),
        ("elementwise", F.relu, 3 * nb),
        ("attention", lambda t: torch.softmax(t, dim=-1), 3 * nb),
    ):
        y = fn(x)
        g = torch.ones_like(y)
        kinds[f"{kind}.bwd"] = nbytes / _best_time_s(
            functools.partial(torch.autograd.grad, y, x, g, retain_graph=True), repeats=3
        )
    return kinds


def _dispatch_times() -> tuple[float, float]:
    """(forward, backward) seconds of one tiny op under autograd: the framework's own cost."""
    # torch only to probe this CPU (once per machine, then cached): the catalog loads without it
    import torch

    p = torch.ones(4, requires_grad=True)
    q = torch.ones(4)
    chain = 200

    def forward_chain():
        y = p
        for _ in range(chain):
            y = y * q
        return y

    fwd_s = _best_time_s(forward_chain, repeats=5) / chain
    total_s = _best_time_s(lambda: forward_chain().sum().backward(), repeats=5) / chain
    return fwd_s, max(total_s - fwd_s, 0.2 * fwd_s)


@lru_cache(maxsize=4)
def _measure_cpu_for(key: str, threads: int) -> CpuProbe:
    path = cache_dir() / "cpu_probe.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(entry, dict):
        try:
            entry = dict(entry)
            entry["matmul_flops_per_s"] = {int(k): float(v) for k, v in entry["matmul_flops_per_s"].items()}
            return CpuProbe(**entry)
        except (TypeError, KeyError, ValueError):
            pass  # a stale or damaged entry: measure again
    with torch_threads(threads):
        probe = _run_probe()
    doc = {k: v for k, v in cached.items()} if isinstance(cached, dict) else {}
    body = {f: getattr(probe, f) for f in probe.__dataclass_fields__}
    body["matmul_flops_per_s"] = {str(k): v for k, v in probe.matmul_flops_per_s.items()}
    doc[key] = body
    try:
        write_atomic(path, json.dumps(doc, indent=1))
    except OSError:
        pass  # a read-only home: the probe is cheap enough to repeat next time
    return probe


def measure_cpu(threads: int | None = None) -> CpuProbe:
    """This machine's CPU rates at `threads` torch threads (None: the caller's count), cached
    under ~/.cache/heterog (or $HETEROG_CACHE_DIR) and measured again when the CPU model,
    the thread count or torch's version changes. Measuring sets the count for the probe only:
    the caller's is left as it was."""
    n = threads or _caller_threads()
    return _measure_cpu_for(_probe_key(n), n)


def _caller_threads() -> int:
    # torch only to read the caller's thread count: the catalog loads without it
    import torch

    return torch.get_num_threads()


def cpu_gpu_type(threads: int | None = None) -> GpuType:
    """The `cpu` device type: this CPU's rates at `threads` torch threads (None: the caller's
    count), recorded in the type (`cpu_threads`) so that every cost of it uses the same probe."""
    n = threads or _caller_threads()
    p = measure_cpu(n)
    fp32 = p.peak_flops_per_s
    return GpuType(
        name=CPU_TYPE,
        vendor="cpu",
        peak_flops_per_s={"fp32": fp32, "tf32": 0.0, "fp16": 0.0, "bf16": p.bf16_matmul_flops_per_s},
        memory_bandwidth_bytes_per_s=p.copy_bandwidth_bytes_per_s,
        memory_bytes=p.memory_bytes,
        intra_node_link="loopback",
        cpu_threads=n,
        # gloo between local processes: shared-memory copies through the loopback interface
        intra_node_bandwidth_bytes_per_s=2e9,
        sources={
            "peak_flops_per_s": f"measured on this machine ({p.key})",
            "memory_bandwidth_bytes_per_s": "measured: 64 MiB copy, bytes read + written",
            "intra_node_link": "gloo point-to-point between processes of one machine, ~2 GB/s "
            "(profile/links.py measures a machine's own)",
        },
    )
