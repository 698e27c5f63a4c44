"""Everything device-specific about a rank, behind one small object: which torch device it
computes on, which backend its process groups use, autocast for the plan's precision, a
gradient scaler for fp16, step timing, and peak memory. The rest of the executor is
device-agnostic: it asks a `RankDevice`.

- CPU ranks (tests, emulated clusters): gloo, wall-clock timing, resident memory.
- CUDA ranks: the GPU the plan names (`cuda:<index>`), NCCL (or gloo with host copies when
  ranks share a GPU), CUDA-event timing of the step and of every instruction (no host
  synchronisation inside the step; one at its end: `Clock`), `torch.cuda.max_memory_allocated`
  / reserved.
- meta ranks (`heterog check --device meta`): shapes only, no memory, no communication.
Mixed precision as `torch.autocast` runs it: amp-bf16 and fp16 compute the listed ops in the
low precision with fp32 master weights; on CPU autocast bf16 (and fp16) exist too, so the
CPU suite exercises the same code path.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from heterog.errors import ClusterError, RankError
from heterog.hardware.catalog import gpu_from_device_name
from heterog.ir.kinds import Precision

# NCCL picks algorithm and protocol per GPU type; ranks of unlike GPUs that pick differently
# hang (reported for A100 with V100, A100 with H100, H100 with H800). One choice for all.
MIXED_NCCL_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankDevice:
    kind: str  # 'cpu' | 'cuda' | 'meta'
    index: int = 0  # the CUDA device index
    host_staging: bool = False  # a CUDA rank that shares its GPU: gloo, tensors cross via the host

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.kind == "cuda" else torch.device(self.kind)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" and not self.host_staging else "gloo"

    def clock(self) -> Clock:
        return Clock(self.kind)

    def activate(self) -> None:
        if self.kind == "cuda":
            torch.cuda.set_device(self.index)
            torch.cuda.reset_peak_memory_stats(self.index)

    def autocast(self, precision: str):
        """The plan's precision: autocast to bf16/fp16 (fp32 master weights), or nothing."""
        if self.kind == "meta":  # no autocast on meta: shapes only
            return contextlib.nullcontext()
        if precision == Precision.AMP_BF16:
            return torch.autocast(self.kind, dtype=torch.bfloat16)
        if precision == Precision.FP16:
            return torch.autocast(self.kind, dtype=torch.float16)
        return contextlib.nullcontext()

    def set_math_mode(self, precision: str) -> None:
        """tf32 (a whole-run setting, as backward's matmuls need it too): matmuls and cuDNN
        convolutions on TF32 tensor cores; a CPU runs tf32 exactly as fp32. Other precisions
        keep torch's defaults (cuDNN convolutions already use TF32 in fp32)."""
        if self.kind == "cuda" and precision == Precision.TF32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def timer(self) -> StepTimer:
        return StepTimer(self)

    def memory(self) -> dict[str, int]:
        """Peak memory of this rank: allocated and reserved on a GPU; resident set on a CPU."""
        if self.kind == "cuda":
            return {
                "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.index)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.index)),
            }
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return {"peak_allocated_bytes": int(rss), "peak_reserved_bytes": int(rss)}

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)


class Clock:
    """Time marks read after the step, so that timing adds no host synchronisation inside it:
    perf_counter values on a CPU; CUDA events recorded on the current stream on a GPU (a
    mark is when the stream reaches it, so a compute span is the GPU's time, and a receive's
    span is how long the compute stream stalled for it). `seconds(a, b)` is valid once the
    marks have completed (after `RankDevice.synchronize`)."""

    def __init__(self, kind: str):
        self.cuda = kind == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class StepTimer:
    """Elapsed time of a step: CUDA events recorded on the stream (read once, after the step),
    or the wall clock on a CPU."""

    def __init__(self, device: RankDevice):
        self.device = device
        if device.kind == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.device.kind == "cuda":
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start(); waits for the GPU to finish the step."""
        if self.device.kind == "cuda":
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


class LossScaler:
    """Dynamic loss scaling for fp16 that every rank applies alike: gradients are unscaled
    after the sync, and a step is skipped on *all* ranks when any rank — or any parameter
    server's gradient sum — saw an inf or NaN (a per-rank GradScaler would let replicas
    diverge). The scale is multiplied by `backoff` on overflow and by `growth` after
    `growth_interval` clean steps (torch.amp.GradScaler's defaults), and the check uses
    GradScaler's own kernel (`torch._amp_foreach_non_finite_check_and_unscale_`), which
    needs no host synchronisation per gradient."""

    def __init__(
        self,
        device: RankDevice,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        growth: float = 2.0,
    ):
        self.device, self.scale, self.growth_interval = device, init_scale, growth_interval
        self.backoff, self.growth = backoff, growth
        self._clean = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params, also=None) -> bool:
        """Unscale the gradients of `params` (and, through `also(found_inf, inv_scale)`, e.g.
        the parameter servers' sums); True when every rank's are finite (a collective over
        all ranks); the scale is updated either way."""
        dev = self.device.torch_device
        found = torch.zeros(1, device=dev)
        inv = torch.full((1,), 1.0 / self.scale, device=dev)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        if also is not None:
            also(found, inv)
        if dist.is_initialized():
            if self.device.host_staging:  # gloo between ranks sharing a GPU: reduce on the host
                found = found.to("cpu")
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        ok = found.item() == 0.0
        self.update(ok)
        return ok

    def update(self, ok: bool) -> None:
        if ok:
            self._clean += 1
            if self._clean >= self.growth_interval:
                self.scale, self._clean = self.scale * self.growth, 0
        else:
            self.scale, self._clean = self.scale * self.backoff, 0


def rank_device(*, use_cuda: bool, index: int = 0, rank: int = 0, host_staging: bool = False) -> RankDevice:
    """The device of a rank: `cuda:<index>` when the run is on GPUs, else the CPU."""
    if use_cuda:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= visible:
            raise RankError(
                rank,
                f"the run is on GPUs but this process sees {visible} CUDA device(s); "
                f"the rank's GPU is index {index}. Check CUDA_VISIBLE_DEVICES on this node.",
            )
        return RankDevice(kind="cuda", index=index, host_staging=host_staging)
    return RankDevice(kind="cpu")


ALLOW_GPU_MISMATCH_ENV = "HETEROG_ALLOW_GPU_MISMATCH"


def check_gpu_type(rdev: RankDevice, expected: str, *, device: str, rank: int) -> None:
    """Refuse to run a rank on a GPU of another type than its plan device's: the plan's
    shares and memory were computed for that type (e.g. the rank meant for a node's sixth
    GPU landing on its fifth, of another kind). HETEROG_ALLOW_GPU_MISMATCH=1 runs anyway."""
    if os.environ.get(ALLOW_GPU_MISMATCH_ENV) == "1":
        return
    name = torch.cuda.get_device_name(rdev.index)
    memory = torch.cuda.get_device_properties(rdev.index).total_memory
    try:
        found = gpu_from_device_name(name, memory).name
    except ClusterError:
        found = None
    if found == expected:
        return
    raise RankError(
        rank,
        f"rank {rank} runs plan device {device!r}, a {expected}, but its GPU cuda:{rdev.index} "
        f"is {name!r} ({f'catalog type {found}' if found else 'not in the catalog'}). Start the "
        f"ranks with the GPUs the plan names (heterog run --torchrun prints CUDA_VISIBLE_DEVICES "
        f"per node), re-plan for this cluster, or set {ALLOW_GPU_MISMATCH_ENV}=1 to run anyway.",
    )


def nccl_env(gpu_types: set[str], override: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """Environment for the ranks of a GPU run, and a note when set: a cluster of unlike GPU
    types gets one NCCL algorithm and protocol on every rank (overridable)."""
    if len(gpu_types) <= 1:
        return dict(override or {}), None
    env = {**MIXED_NCCL_ENV, **(override or {})}
    note = (
        f"unlike GPU types ({', '.join(sorted(gpu_types))}): every rank uses NCCL_ALGO={env['NCCL_ALGO']} "
        f"NCCL_PROTO={env['NCCL_PROTO']} so that their collectives agree"
    )
    return env, note
