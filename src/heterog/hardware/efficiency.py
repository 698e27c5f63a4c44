"""Efficiency curves: the fraction of a device's data-sheet peak that a kernel of a given
size reaches. Calibrated on one H200 (data/h200_micro.json) and scaled to other GPUs; the
`cpu` type uses the curve its own probe measured (hardware.cpu_probe.measure_cpu).

Calibration. Each H200 point is a square n×n×n product timed with CUDA events around one
call; the smallest sizes all take ~20 µs, which is launch + event latency, not kernel time.
We subtract a measurement floor (MEASUREMENT_FLOOR_S) before computing the efficiency, since
the cost model adds its own per-kernel costs (hardware.catalog.host_overheads).

Scaling to other GPUs. A product saturates a GPU once it has an output tile for each of its
compute units (SMs); tiles grow as n², so a GPU with U units reaches the H200's efficiency at
size n·sqrt(U / U_H200): eff_X(n) = eff_H200(n · sqrt(U_H200 / U_X)). A type without public
figures (a custom type of a cluster file) has no unit count: its peak stands in for it,
eff_X(n) = eff_H200(n · sqrt(P_H200 / P_X)). Each type then applies its own figures
(hardware.gputype.Efficiency, catalog.yaml; fitted on its measurements or derived from its
public figures, hardware/public_model.py): the size shift `size_scale`, the compute factor per
precision (cost.roofline), and its sustained memory bandwidth per kind of op
(memory_efficiency).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

from heterog.hardware.catalog import memory_by_kind_default
from heterog.hardware.cpu_probe import measure_cpu
from heterog.hardware.gputype import GpuType
from heterog.ir.kinds import Phase

MEASUREMENT_FLOOR_S = 15e-6
# H200 SXM data-sheet dense peaks (catalog.yaml) that the measured throughputs are divided by.
_H200_PEAK_FLOPS_PER_S = {"fp32": 67e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12}
_H200_BANDWIDTH_BYTES_PER_S = 4.8e12
MIN_EFFICIENCY = 1e-3


@dataclass(frozen=True, slots=True)
class Curve:
    """Efficiency as a piecewise-linear function of log(n), flat above the largest size and
    falling as (n/n_min)^falloff below the smallest: a GPU kernel too small to fill the SMs
    takes about as long as the smallest measured one (falloff 3); a CPU core loses reuse,
    not parallelism (falloff 1)."""

    log_sizes: np.ndarray
    efficiency: np.ndarray
    falloff: float = 3.0

    def at(self, n: np.ndarray | float) -> np.ndarray:
        n = np.maximum(np.asarray(n, dtype=float), 1.0)
        logn = np.log(n)
        # geometric between points (eff ∝ n^α, α ≤ 3 on every measured segment), so a
        # kernel's time F / eff never falls as its work grows; linear interpolation did
        eff = np.exp(np.interp(logn, self.log_sizes, np.log(np.maximum(self.efficiency, MIN_EFFICIENCY))))
        small = logn < self.log_sizes[0]
        if np.any(small):
            eff = np.where(small, self.efficiency[0] * np.exp(self.falloff * (logn - self.log_sizes[0])), eff)
        return np.maximum(eff, MIN_EFFICIENCY)

    def scaled(self, size_factor: float) -> Curve:
        """eff'(n) = eff(n · size_factor)."""
        return Curve(self.log_sizes - math.log(size_factor), self.efficiency, self.falloff)


@lru_cache(maxsize=1)
def _h200_doc() -> dict:
    return json.loads(resources.files("heterog.hardware").joinpath("data", "h200_micro.json").read_text())


@lru_cache(maxsize=8)
def h200_curve(precision: str) -> Curve:
    """precision in fp32 / tf32 / fp16 / bf16."""
    pts = sorted((r["m"], r["median_ms"] * 1e-3) for r in _h200_doc()["matmul"] if r["dtype"] == precision)
    assert pts, f"no H200 points for {precision}"
    peak = _H200_PEAK_FLOPS_PER_S[precision]
    best = max(2 * n**3 / t for n, t in pts) / peak  # the large-size plateau, uncorrected
    sizes, effs = [], []
    for n, t in pts:
        kernel_s = max(t - MEASUREMENT_FLOOR_S, 2 * n**3 / (peak * best), 1e-9)
        sizes.append(math.log(n))
        effs.append(min(2 * n**3 / kernel_s / peak, best))
    return Curve(np.array(sizes), np.maximum.accumulate(np.array(effs)))


def h200_plateau(precision: str) -> float:
    """The H200 sweep's large-product efficiency at a catalog precision (its curve's top)."""
    return float(h200_curve(precision if precision in _H200_PEAK_FLOPS_PER_S else "fp32").efficiency.max())


def h200_compute_units() -> int:
    """SMs of the H200 the sweep ran on (h200_micro.json `env.sm_count`)."""
    return int(_h200_doc()["env"]["sm_count"])


def h200_copy_efficiency() -> float:
    return min(_h200_doc()["copy"]["gbps"] * 1e9 / _H200_BANDWIDTH_BYTES_PER_S, 1.0)


def gpu_curve(gpu: GpuType, precision: str) -> Curve:
    """The matmul efficiency curve of `gpu` at a catalog precision (fp32/tf32/fp16/bf16)."""
    if gpu.vendor == "cpu":
        return cpu_curve(gpu.cpu_threads)
    base = h200_curve(precision if precision in _H200_PEAK_FLOPS_PER_S else "fp32")
    if gpu.public is not None:
        ruled = base.scaled(math.sqrt(h200_compute_units() / gpu.public.compute_units))
    else:
        peak = gpu.peak_flops_per_s.get(precision) or gpu.peak_flops_per_s["fp32"]
        ruled = base.scaled(math.sqrt(_H200_PEAK_FLOPS_PER_S[precision] / peak))
    scale = gpu.efficiency.size_scale
    if scale == 1.0:
        return ruled
    shifted = ruled.scaled(1.0 / scale)
    if scale < 1.0:
        return shifted
    # A type that saturates later (scale > 1) keeps the smallest kernel's time of the rule by
    # peak: efficiency stays at its smallest measured value from that size up to the shifted
    # one, so tiny kernels are not charged like the shifted curve's smallest product.
    return Curve(
        np.concatenate([ruled.log_sizes[:1], shifted.log_sizes]),
        np.concatenate([shifted.efficiency[:1], shifted.efficiency]),
        shifted.falloff,
    )


@lru_cache(maxsize=4)
def cpu_curve(threads: int | None = None) -> Curve:
    p = measure_cpu(threads)
    peak = p.peak_flops_per_s
    sizes = sorted(p.matmul_flops_per_s)
    effs = np.maximum.accumulate(np.array([p.matmul_flops_per_s[n] / peak for n in sizes]))
    return Curve(np.log(np.array(sizes, dtype=float)), effs, falloff=1.0)


def kind_factor(own: dict[str, float], default: dict[str, float], kind: str) -> float:
    """A memory-bound kind's bandwidth relative to a copy: the type's own, else the catalog
    default; batch norm without a figure of its own streams like an element-wise kernel
    (cost/kernels.py)."""
    for table in (own, default):
        if kind in table:
            return table[kind]
    return kind_factor(own, default, "elementwise") if kind == "batchnorm" else 1.0


def memory_efficiency(gpu: GpuType, kind: str | None = None, phase: Phase = Phase.FORWARD) -> float:
    """Achievable fraction of data-sheet memory bandwidth for streaming kernels of `kind`.
    GPUs: the type's sustained copy fraction (catalog `efficiency.memory`; else the H200
    copy's) times the kind's own factor (`efficiency.memory_by_kind`). CPU: its bandwidth is itself a measured
    copy; batch norm, pooling, GELU and softmax were measured by the probe too (they run
    far below copy speed there: several passes, index bookkeeping, transcendentals)."""
    if gpu.vendor != "cpu":
        e = gpu.efficiency
        base = e.memory if e.memory is not None else h200_copy_efficiency()
        if kind is None:
            return base
        return base * kind_factor(e.memory_by_kind, memory_by_kind_default(), kind)
    if kind is None:
        return 1.0
    p = measure_cpu(gpu.cpu_threads)
    rate = p.kind_bandwidth_bytes_per_s.get(kind if phase == Phase.FORWARD else f"{kind}.bwd")  # the probe's keys
    return 1.0 if rate is None else float(np.clip(rate / p.copy_bandwidth_bytes_per_s, 0.02, 4.0))
