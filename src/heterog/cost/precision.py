"""Precisions as each card runs them, and the one that suits a cluster.

A plan runs in one precision on every device, but not every device has a fast path for
it: bf16 needs Ampere or newer tensor cores (a V100, T4, P100 or GTX 1080 Ti has none), TF32
too, and fp16 runs on tensor cores from Volta on and at twice the fp32 rate on a P100 — at
1/64 of it on a GTX 1080 Ti, where cuBLAS computes in fp32. The cost model already runs a
precision where it has no fast path at that device's fp32 rate (GpuType.catalog_precision),
with the casts and half-size activations autocast still makes; this module says so to the
user and names the precision whose summed data-sheet rate over the cluster's devices is
highest, which is the one a heterogeneous cluster's slow-path cards pay least for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from heterog.hardware.cluster import Cluster
from heterog.hardware.gputype import GpuType
from heterog.ir.kinds import Precision

# A precision is suggested only when the cluster's summed rate in it is at least this much
# higher: a few percent is within what the data-sheet rates say about real kernels
SUGGEST_GAIN = 1.2
# Among precisions of equal rate: no loss scale needed first (bf16's range is fp32's)
PREFERENCE = (Precision.AMP_BF16, Precision.FP16, Precision.TF32, Precision.FP32)
HOW_IT_RUNS = {
    "bf16": "bf16 tensor cores",
    "fp16": "fp16 tensor cores",
    "tf32": "TF32 tensor cores",
    "fp32": "its fp32 rate",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TypePrecision:
    """How the devices of one type run a plan precision."""

    gpu_type: str
    devices: int
    runs_as: str  # the catalog precision its matmuls and convolutions run at
    accelerated: bool  # faster than fp32 there


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionAdvice:
    precision: str
    types: tuple[TypePrecision, ...]
    suggested: str | None  # when some devices have no fast path: a precision the
    # cluster runs markedly faster in, or None
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        return {
            "precision": self.precision,
            "suggested": self.suggested,
            "notes": list(self.notes),
            "types": [
                {"gpu_type": t.gpu_type, "devices": t.devices, "runs_as": t.runs_as, "accelerated": t.accelerated}
                for t in self.types
            ],
        }


def how_it_runs(gpu: GpuType, precision: str) -> str:
    p = gpu.catalog_precision(precision)
    if p == "fp16" and gpu.public is not None and gpu.public.tensor_cores == "none":
        return "paired fp16 on CUDA cores, 2x fp32"
    return HOW_IT_RUNS[p]


def summed_rate_flops_per_s(types: dict[str, tuple[GpuType, int]], precision: str) -> float:
    """The cluster's data-sheet rate in `precision`: each device at the peak it runs it at."""
    return sum(n * g.peak_flops_per_s[g.catalog_precision(precision)] for g, n in types.values())


def precision_advice(cluster: Cluster, precision: str) -> PrecisionAdvice:
    """How each device type of `cluster` runs `precision`, and a better precision if any."""
    counts = Counter(d.gpu_type for d in cluster.devices)
    types = {name: (cluster.gpu_types[name], n) for name, n in counts.items()}
    rows = tuple(
        TypePrecision(
            gpu_type=name, devices=n, runs_as=g.catalog_precision(precision), accelerated=g.accelerates(precision)
        )
        for name, (g, n) in types.items()
    )
    notes = []
    slow = [t for t in rows if not t.accelerated and precision != Precision.FP32]
    gpus = [t for t in rows if types[t.gpu_type][0].vendor != "cpu"]
    if slow and gpus:
        names = ", ".join(f"{t.gpu_type} ({t.devices})" for t in slow)
        notes.append(
            f"{precision} has no fast path on {names}: costed as those devices run it, at their "
            f"fp32 rate"
            + (
                " with autocast's casts and half-size activations"
                if precision in (Precision.AMP_BF16, Precision.FP16)
                else ""
            )
            + "."
        )
    rate = {p: summed_rate_flops_per_s(types, p) for p in PREFERENCE}
    best = max(PREFERENCE, key=lambda p: (rate[p], -PREFERENCE.index(p)))
    suggested = None
    if slow and gpus and best != precision and rate[best] >= SUGGEST_GAIN * rate[Precision(precision)]:
        suggested = str(best)
        fast = [
            f"{t.gpu_type} ({how_it_runs(types[t.gpu_type][0], best)})"
            for t in rows
            if types[t.gpu_type][0].accelerates(best)
        ]
        scale = " (with a loss scale: the executor's gradient scaler)" if best == Precision.FP16 else ""
        notes.append(
            f"{best}{scale} suits these devices better: {rate[best] / rate[Precision(precision)]:.1f}x "
            f"the summed data-sheet rate of {precision}; fast on {', '.join(fast)}. "
            f"Use --precision {best}."
        )
    return PrecisionAdvice(precision=str(precision), types=rows, suggested=suggested, notes=tuple(notes))
