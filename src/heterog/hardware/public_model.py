"""A GPU type's sustained efficiency from its public figures alone.

A type that was measured keeps the figures fitted on its measurements (catalog.yaml
`efficiency`). Every other type — the power-limited and inference cards people add to a
cluster, old ones, new ones — gets its figures from what its data sheet says, through a few
constants shared by all types (catalog.yaml `public_model`, fitted across the measured
types; `benchmarks/predict_gpu.py --leave-one-type-out` scores the rule on each measured type
with none of its own measurements). Never from a sibling's fitted efficiency: a sibling's
figures carry its clocks, its power limit and the harness that measured it.

The rule (hardware.gputype.PublicFigures holds the inputs):

- **Sustained clock.** Data-sheet peaks assume the boost clock; a dense training kernel holds
  the clock the board power allows. NVIDIA defines the base clock as the one guaranteed at
  the board's power under a heavy load, and that is what a GEMM gets: a 70 W T4 (585 MHz
  base, 1590 MHz boost) reaches ~24 TF of its 65 TF FP16 in cuBLAS, "due to power capping"
  (NVIDIA developer forum, forums.developer.nvidia.com/t/about-gpu-peak-performance/264462),
  which this rule predicts within 10 % without having seen it (tests/test_cost_public_model.py).
  A free interpolation between base and boost, fitted on the measured types instead, is not
  identified by them (their base clocks are 76-90 % of their boost clocks; it wandered between
  the two across the leave-one-type-out folds); with the T4 figure among the data it settles
  on the base clock. A vendor that publishes no base clock gets `default_base_fraction` of its
  boost.
- **Tensor-core plateau.** cuBLAS and cuDNN kernels keep full-rate tensor cores busy only as
  far as registers and shared memory feed them; half-rate units (GeForce parts accumulating
  in FP32: RTX 2080 Ti, 3090, 4090) are easy to feed. The work one compute unit does per
  boost-clock cycle, R = peak / (units × boost), measures it (512 FLOP for a 3090's FP16,
  1024 for a V100, 2048 for an A100, ~3800 for an H100), counted in half-precision operands:
  a TF32 operand is a 4-byte word in registers and shared memory, so TF32 doubles R (a
  refinement chosen after the GH200's and A100's TF32 layers came out too fast against their
  FP16 ones in the leave-one-type-out scores; docs/cost_model.md says how much it moved):
  plateau = tensor_efficiency × (R / 1024)^−tensor_rate_exponent × base / boost, at most 1.
- **CUDA-core plateau** (fp32, and P100's paired fp16): simt_efficiency × base / boost.
- **Memory**: memory_efficiency of the data-sheet bandwidth — what the measured layers'
  memory-bound kernels (layer norm, softmax, dropout) reach, not a copy's best.
- **Small kernels**: the H200's measured curve, shifted by the square root of the ratio of
  compute units (hardware/efficiency.py `gpu_curve`): a product saturates a GPU once it has a
  tile for every unit.

The type's `compute[p]` factor is its plateau over the H200 sweep's plateau at p, since every
type's curve is the H200's scaled (hardware/efficiency.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from heterog.hardware.gputype import Efficiency, GpuType, PublicFigures, TensorCores

# FLOP per compute unit per boost-clock cycle of the reference rate: a Volta or Turing SM's
# eight full-rate tensor cores, 64 FMA each (NVIDIA Volta whitepaper)
REFERENCE_RATE_FLOP_PER_CYCLE = 1024.0
OPERAND_BYTES = {"tf32": 4, "fp16": 2, "bf16": 2}
MODEL_FIELDS = (
    "tensor_efficiency",
    "tensor_rate_exponent",
    "simt_efficiency",
    "memory_efficiency",
    "default_base_fraction",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PublicModel:
    """The constants every type without measurements shares (catalog.yaml `public_model`)."""

    tensor_efficiency: float  # tensor-core GEMM plateau at R = 1024, at the base clock
    tensor_rate_exponent: float  # how much harder a unit of R FLOP/cycle is to feed
    simt_efficiency: float  # CUDA-core GEMM plateau at the base clock
    memory_efficiency: float  # memory-bound kernels: fraction of data-sheet bandwidth
    default_base_fraction: float  # base / boost where no base clock is published
    source: str = ""

    def __post_init__(self) -> None:
        for f in MODEL_FIELDS:
            v = getattr(self, f)
            if not (math.isfinite(v) and 0.0 <= v <= 4.0):
                raise ValueError(f"public_model.{f} = {v!r}: expected a factor in [0, 4].")
        if not 0.0 < self.memory_efficiency <= 1.0 or not 0.0 < self.default_base_fraction <= 1.0:
            raise ValueError("public_model.memory_efficiency and default_base_fraction are fractions in (0, 1].")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PublicModel:
        return PublicModel(**{f: float(d[f]) for f in MODEL_FIELDS}, source=str(d.get("source", "")))

    def clock_fraction(self, pub: PublicFigures) -> float:
        """Sustained clock of a dense kernel over the boost clock the peaks assume."""
        if pub.base_clock_mhz is None:
            return self.default_base_fraction
        return pub.base_clock_mhz / pub.boost_clock_mhz

    def plateau(self, gpu: GpuType, precision: str) -> float:
        """The fraction of the data-sheet peak a large GEMM sustains at catalog precision p."""
        pub = _public(gpu)
        clock = self.clock_fraction(pub)
        peak = gpu.peak_flops_per_s.get(precision, 0.0)
        if precision == "fp32" or peak <= 0 or pub.tensor_cores == TensorCores.NONE:
            return min(1.0, self.simt_efficiency * clock)
        # what the unit must be fed: its FLOP per cycle, in half-precision operands (a TF32
        # operand is a 4-byte fp32 word in registers and shared memory: twice the bytes per FLOP)
        rate = peak / (pub.compute_units * pub.boost_clock_mhz * 1e6) * OPERAND_BYTES.get(precision, 2) / 2
        return min(
            1.0, self.tensor_efficiency * (rate / REFERENCE_RATE_FLOP_PER_CYCLE) ** -self.tensor_rate_exponent * clock
        )

    def efficiency(self, gpu: GpuType) -> Efficiency:
        """The type's Efficiency, derived (compute factors relative to the H200 sweep)."""
        # catalog.py and efficiency.py derive a type's efficiency with this module: a cycle
        from heterog.hardware.efficiency import h200_plateau

        pub = _public(gpu)
        compute = {
            p: self.plateau(gpu, p) / h200_plateau(p)
            for p in ("fp32", "tf32", "fp16", "bf16")
            if gpu.peak_flops_per_s.get(p, 0.0) > 0
        }
        base = (
            f"{pub.base_clock_mhz:g} MHz base"
            if pub.base_clock_mhz is not None
            else f"no published base clock: {self.default_base_fraction:g} x"
        )
        return Efficiency(
            compute=compute,
            memory=self.memory_efficiency,
            source=f"derived from public figures (hardware/public_model.py): {base} of "
            f"{pub.boost_clock_mhz:g} MHz boost, {pub.compute_units} compute units, "
            f"{pub.tensor_cores} tensor cores; the catalog's public_model constants",
        )


def _public(gpu: GpuType) -> PublicFigures:
    if gpu.public is None:
        raise ValueError(
            f"GPU type {gpu.name} has no public figures to derive its efficiency from; "
            f"give it `public:` in the catalog or an `efficiency:` of its own."
        )
    return gpu.public


@lru_cache(maxsize=1)
def packaged_public_model() -> PublicModel:
    """The constants shipped in catalog.yaml."""
    # catalog.py and efficiency.py derive a type's efficiency with this module: a cycle
    from heterog.hardware.catalog import catalog_document

    return PublicModel.from_dict(catalog_document()["public_model"])


def derive(gpu: GpuType, model: PublicModel | None = None) -> GpuType:
    """`gpu` with its efficiency derived from its public figures."""
    return replace(gpu, efficiency=(model or packaged_public_model()).efficiency(gpu))
