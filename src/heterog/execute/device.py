"""Everything device-specific about a rank, behind one small object: which torch device it
computes on, which backend its process groups use, autocast for the plan's precision, a
gradient scaler for fp16, step timing, and peak memory. The rest of the executor is
device-agnostic: it asks a `RankDevice`.

- CPU ranks (tests, emulated clusters): gloo, wall-clock timing, resident memory.
- CUDA ranks: `cuda:<local rank>`, NCCL, CUDA-event step timing (no host synchronisation
  inside the step; one at its end), `torch.cuda.max_memory_allocated` / reserved.
Mixed precision as `torch.autocast` runs it: amp-bf16 and fp16 compute the listed ops in the
low precision with fp32 master weights; on CPU autocast bf16 (and fp16) exist too, so the
CPU suite exercises the same code path.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from heterog.ir.kinds import Precision

# NCCL picks algorithm and protocol per GPU type; ranks of unlike GPUs that pick differently
# hang (reported for A100 with V100, A100 with H100, H100 with H800). One choice for all.
MIXED_NCCL_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankDevice:
    kind: str            # 'cpu' | 'cuda'
    index: int = 0       # the CUDA device index (local rank)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.kind == "cuda" else torch.device("cpu")

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def activate(self) -> None:
        if self.kind == "cuda":
            torch.cuda.set_device(self.index)
            torch.cuda.reset_peak_memory_stats(self.index)

    def autocast(self, precision: str):
        """The plan's precision: autocast to bf16/fp16 (fp32 master weights), or nothing."""
        if precision == Precision.AMP_BF16:
            return torch.autocast(self.kind, dtype=torch.bfloat16)
        if precision == Precision.FP16:
            return torch.autocast(self.kind, dtype=torch.float16)
        return contextlib.nullcontext()

    def timer(self) -> "StepTimer":
        return StepTimer(self)

    def memory(self) -> dict[str, int]:
        """Peak memory of this rank: allocated and reserved on a GPU; resident set on a CPU."""
        if self.kind == "cuda":
            return {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.index)),
                    "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.index))}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
        return {"peak_allocated_bytes": int(rss), "peak_reserved_bytes": int(rss)}


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
    after the sync, and a step is skipped on *all* ranks when any rank saw an inf or NaN (a
    per-rank GradScaler would let replicas diverge). The scale halves on overflow and doubles
    after `growth_interval` clean steps (torch.amp.GradScaler's defaults)."""

    def __init__(self, device: RankDevice, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.device, self.scale, self.growth_interval = device, init_scale, growth_interval
        self._clean = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params) -> bool:
        """Unscale the gradients; True when every rank's are finite (a collective over all ranks)."""
        finite = torch.ones(1, device=self.device.torch_device)
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
                if not torch.isfinite(p.grad).all():
                    finite.zero_()
        if dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        ok = bool(finite.item())
        if ok:
            self._clean += 1
            if self._clean >= self.growth_interval:
                self.scale, self._clean = self.scale * 2.0, 0
        else:
            self.scale, self._clean = self.scale / 2.0, 0
        return ok


def rank_device(*, use_cuda: bool, local_rank: int) -> RankDevice:
    """The device of a rank: `cuda:<local rank>` when the run is on GPUs, else the CPU."""
    if use_cuda:
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            from heterog.errors import RankError
            raise RankError(local_rank, f"the run is on GPUs but this process sees "
                                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                                        f"CUDA device(s); local rank {local_rank} has none.")
        return RankDevice(kind="cuda", index=local_rank)
    return RankDevice(kind="cpu")


def nccl_env(gpu_types: set[str], override: dict[str, str] | None = None) -> tuple[dict[str, str], str | None]:
    """Environment for the ranks of a GPU run, and a note when set: a cluster of unlike GPU
    types gets one NCCL algorithm and protocol on every rank (overridable)."""
    if len(gpu_types) <= 1:
        return dict(override or {}), None
    env = {**MIXED_NCCL_ENV, **(override or {})}
    note = (f"unlike GPU types ({', '.join(sorted(gpu_types))}): every rank uses NCCL_ALGO={env['NCCL_ALGO']} "
            f"NCCL_PROTO={env['NCCL_PROTO']} so that their collectives agree")
    return env, note
