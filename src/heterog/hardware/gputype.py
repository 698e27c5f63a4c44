"""The facts about one kind of accelerator that the cost model needs. The table of known
types is data (catalog.yaml), each figure with its public source.

Four records describe a type:
- `GpuType`: data-sheet peaks, memory, intra-node link;
- `PublicFigures`: what else the data sheets say about how it runs — compute units, base and
  boost clocks, board power, tensor-core generation, memory technology;
- `Efficiency`: what the type sustains of its peaks in training kernels (power- and
  clock-limited cards reach far less than SXM parts): fitted per type on measured layers
  where the type was measured, else derived from its public figures (hardware/public_model.py);
- `HostCosts`: what eager PyTorch's host (Python, dispatcher, autograd, autocast) spends per
  op while driving this device. The host is a property of the machine, so every GPU type
  shares one default unless a calibration (`heterog calibrate`) measured its own;
- `Price`: a list price per GPU-hour, with the page it was read from and the date that page
  states (a cluster file's `price_per_hour` overrides it: hardware/prices.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from heterog.ir.kinds import CATALOG_PRECISION

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


class TensorCores(StrEnum):
    """The matrix-unit generation of a type: which precisions it accelerates and how much
    work one unit does per clock follow from it (and from the peaks the data sheet gives)."""

    NONE = "none"  # Pascal and older: no matrix units (P100's fp16 is 2× fp32 SIMT)
    VOLTA = "volta"  # fp16
    TURING = "turing"  # fp16
    AMPERE = "ampere"  # fp16, bf16, tf32
    ADA = "ada"  # fp16, bf16, tf32 (fp8)
    HOPPER = "hopper"  # fp16, bf16, tf32 (fp8); cuDNN attention in half precision
    BLACKWELL = "blackwell"  # fp16, bf16, tf32 (fp8, fp4)
    CDNA2 = "cdna2"  # AMD matrix cores: fp16, bf16, fp32 matrix
    CDNA3 = "cdna3"  # AMD matrix cores: fp16, bf16, tf32


@dataclass(frozen=True, kw_only=True, slots=True)
class PublicFigures:
    """Data-sheet facts beyond the peaks, from which a type's sustained efficiency is derived
    when it has no measurements (hardware/public_model.py). The peaks assume the boost clock; a
    dense training kernel holds the clock the board power allows, which the base clock
    bounds (NVIDIA defines it as the clock guaranteed at the board's power under a heavy
    load): a 70 W T4 runs its GEMMs near 585 MHz, not at its 1590 MHz boost."""

    compute_units: int  # SMs (NVIDIA) or CUs (AMD)
    boost_clock_mhz: float  # the clock the data-sheet peaks are computed at
    base_clock_mhz: float | None  # None: not published (AMD, B200)
    board_power_w: float
    tensor_cores: TensorCores
    memory_type: str  # 'HBM3e', 'GDDR6', …
    source: str = ""

    def __post_init__(self) -> None:
        if self.compute_units < 1:
            raise ValueError(f"public.compute_units = {self.compute_units!r}: the number of SMs or CUs, ≥ 1.")
        if not self.boost_clock_mhz > 0 or not self.board_power_w > 0:
            raise ValueError("public.boost_clock_mhz and board_power_w must be positive.")
        if self.base_clock_mhz is not None and not 0 < self.base_clock_mhz <= self.boost_clock_mhz:
            raise ValueError(
                f"public.base_clock_mhz = {self.base_clock_mhz!r}: positive and at most the "
                f"boost clock ({self.boost_clock_mhz} MHz)."
            )
        if self.tensor_cores not in tuple(TensorCores):
            raise ValueError(f"public.tensor_cores = {self.tensor_cores!r}: one of {', '.join(TensorCores)}.")

    def to_dict(self) -> dict:
        return {
            "compute_units": self.compute_units,
            "boost_clock_mhz": self.boost_clock_mhz,
            "base_clock_mhz": self.base_clock_mhz,
            "board_power_w": self.board_power_w,
            "tensor_cores": str(self.tensor_cores),
            "memory_type": self.memory_type,
            "source": self.source,
        }

    @staticmethod
    def from_dict(d: dict) -> PublicFigures:
        """ValueError (KeyError for a missing field) when malformed."""
        base = d.get("base_clock_mhz")
        return PublicFigures(
            compute_units=int(d["compute_units"]),
            boost_clock_mhz=float(d["boost_clock_mhz"]),
            base_clock_mhz=None if base is None else float(base),
            board_power_w=float(d["board_power_w"]),
            tensor_cores=TensorCores(d["tensor_cores"]),
            memory_type=str(d.get("memory_type", "")),
            source=str(d.get("source", "")),
        )


# memory-bound op kinds with their own sustained bandwidth (cost.roofline reads these)
MEMORY_KINDS = ("elementwise", "norm", "batchnorm", "pool", "embedding", "memory", "loss", "optimizer")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostCosts:
    """Host time per op of eager PyTorch on one device type, and the device's own minimum
    per kernel. A step runs at the pace of whichever of host and device is behind, op by op
    (cost.roofline), so at small batches these set the step time."""

    forward_node_s: float  # one module call: Python hooks + the first op's dispatch
    forward_op_s: float  # each further aten op of a node's forward
    backward_op_s: float  # each op the autograd engine runs in backward
    autocast_cast_s: float  # each cast autocast inserts (forward; its backward too)
    optimizer_tensor_s: float  # foreach optimizer: host cost per parameter tensor
    kernel_gap_s: float = 2.0e-6  # device: minimum time of one kernel, launch to completion
    # extra host time of an op run through cuDNN's frontend API (convolution forward and
    # backward; attention on Hopper in half precision): its graph/plan cache look-up, beyond
    # what an ordinary op costs (cost.host.cudnn_calls says which nodes make such calls);
    # a node's host_speed does not scale it (cost/host.py says why)
    cudnn_op_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in (
            "forward_node_s",
            "forward_op_s",
            "backward_op_s",
            "autocast_cast_s",
            "optimizer_tensor_s",
            "kernel_gap_s",
            "cudnn_op_s",
        ):
            v = getattr(self, f)
            if not (v >= 0.0):
                raise ValueError(f"host costs: {f} must be ≥ 0 seconds, found {v!r}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """Sustained fractions of the data-sheet peaks, relative to what the H200-calibrated
    curves (hardware.efficiency) predict for a type of this peak: compute[p] multiplies the
    tensor-core efficiency at precision p ('fp32' = CUDA cores; 1.0 = as the H200 scaled),
    memory is the fraction of data-sheet bandwidth a streaming copy reaches, and
    memory_by_kind the fraction a kind of memory-bound op reaches relative to that copy
    (kinds not given: the catalog's `memory_by_kind_default`, fitted on the H200 steps)."""

    compute: dict[str, float] = field(default_factory=dict)
    # cuDNN convolutions in half precision (bf16/fp16), a further factor on compute[p]: the
    # only data on them is resnet50's amp-bf16 steps, so the figure is kept apart from the
    # transformers' matmul figures it would otherwise be traded against
    conv: dict[str, float] = field(default_factory=dict)
    memory: float | None = None  # None: the H200's measured copy fraction
    memory_by_kind: dict[str, float] = field(default_factory=dict)
    # the type reaches the efficiency the scaled H200 curve gives at size n only at
    # n · size_scale (> 1: small kernels fill this type's SMs worse than the rule predicts)
    size_scale: float = 1.0
    inherits: str = ""  # the catalog type a calibration was made of
    # (`heterog calibrate`); catalog types: ""
    source: str = ""

    def __post_init__(self) -> None:
        for p, v in self.compute.items():
            if p not in PRECISIONS or not (0.0 < v <= 4.0):
                raise ValueError(
                    f"efficiency.compute[{p!r}] = {v!r}: precision must be one of "
                    f"{', '.join(PRECISIONS)} and the factor in (0, 4]."
                )
        for p, v in self.conv.items():
            if p not in ("bf16", "fp16") or not (0.0 < v <= 4.0):
                raise ValueError(
                    f"efficiency.conv[{p!r}] = {v!r}: precision must be bf16 or fp16 "
                    f"(fp32 convolutions take compute['tf32']) and the factor in (0, 4]."
                )
        if self.memory is not None and not (0.0 < self.memory <= 1.0):
            raise ValueError(f"efficiency.memory = {self.memory!r}: a fraction of the data-sheet bandwidth, in (0, 1].")
        if not (0.05 <= self.size_scale <= 20.0):
            raise ValueError(f"efficiency.size_scale = {self.size_scale!r}: expected a factor in [0.05, 20].")
        for k, v in self.memory_by_kind.items():
            if k not in MEMORY_KINDS or not (0.0 < v <= 2.0):
                raise ValueError(
                    f"efficiency.memory_by_kind[{k!r}] = {v!r}: kind must be one of "
                    f"{', '.join(MEMORY_KINDS)} and the factor in (0, 2]."
                )

    def compute_factor(self, precision: str) -> float:
        return self.compute.get(precision, 1.0)

    def conv_factor(self, precision: str) -> float:
        return self.conv.get(precision, 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Price:
    """What one device of a type costs per hour, in US dollars: a public on-demand list price,
    the page it was read from and the date that page states. Prices move; the date says how
    old a figure is, and a cluster file's own `price_per_hour` replaces it."""

    usd_per_hour: float
    source: str = ""
    date: str = ""  # as the source states it (YYYY-MM-DD)

    def __post_init__(self) -> None:
        if not (self.usd_per_hour >= 0.0 and math.isfinite(self.usd_per_hour)):
            raise ValueError(f"price.usd_per_hour must be a finite number ≥ 0, found {self.usd_per_hour!r}.")

    def to_dict(self) -> dict:
        return {"usd_per_hour": self.usd_per_hour, "source": self.source, "date": self.date}

    @staticmethod
    def from_dict(d: dict) -> Price:
        """ValueError (KeyError for a missing figure) when malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a price is a mapping {{usd_per_hour, source, date}}, found {d!r}")
        return Price(
            usd_per_hour=float(d["usd_per_hour"]), source=str(d.get("source", "")), date=str(d.get("date", ""))
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuType:
    name: str  # e.g. 'A100-80GB'
    vendor: str  # 'nvidia', 'amd', 'cpu'
    peak_flops_per_s: dict[str, float]  # dense, per precision in PRECISIONS (0 = unsupported)
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    intra_node_link: str  # 'nvlink3', 'pcie3', ...
    intra_node_bandwidth_bytes_per_s: float  # per direction, per device
    sources: dict[str, str] = field(default_factory=dict)  # figure → public source
    efficiency: Efficiency = field(default_factory=Efficiency)
    host: HostCosts | None = None  # None: the vendor's default (catalog host_overheads)
    public: PublicFigures | None = None  # None: a custom type with peaks only
    cpu_threads: int | None = None  # the measured `cpu` type: the torch threads its rates are for
    price: Price | None = None  # None: no public list price found (catalog.yaml says which)

    def __post_init__(self) -> None:
        for p in PRECISIONS:
            if self.peak_flops_per_s.get(p, 0.0) < 0:
                raise ValueError(f"GPU type {self.name}: peak_flops_per_s[{p}] must be ≥ 0.")
        if self.memory_bandwidth_bytes_per_s <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"GPU type {self.name}: memory bandwidth and size must be positive.")

    def catalog_precision(self, precision: str) -> str:
        """The catalog precision whose peak a tensor-core kernel runs at when a plan runs in
        `precision` (fp32 / tf32 / amp-bf16 / fp16): the half or TF32 rate where the type
        has one, else its fp32 rate — how PyTorch runs it there (bf16 on a Volta or Turing
        card has no tensor-core path; a GTX 1080 Ti's fp16 runs at 1/64 rate, and cuBLAS
        computes it in fp32)."""
        want = CATALOG_PRECISION.get(precision, "fp32")
        return want if self.peak_flops_per_s.get(want, 0.0) > 0 else "fp32"

    def accelerates(self, precision: str) -> bool:
        """Whether a plan precision runs faster here than fp32 does (fp32 itself: True)."""
        p = self.catalog_precision(precision)
        return (
            p == "fp32"
            if precision == "fp32"
            else (p != "fp32" and self.peak_flops_per_s[p] > self.peak_flops_per_s["fp32"])
        )


def gpu_extras_to_dict(g: GpuType) -> dict:
    """The efficiency and host costs of `g` as plain data (for a Cluster saved in a plan):
    empty when they are the defaults, so older documents stay as they were."""
    out: dict = {}
    if g.efficiency != Efficiency():
        e = g.efficiency
        out["efficiency"] = {
            "compute": dict(e.compute),
            "memory": e.memory,
            "memory_by_kind": dict(e.memory_by_kind),
            "size_scale": e.size_scale,
            "inherits": e.inherits,
            "source": e.source,
        }
        if e.conv:
            out["efficiency"]["conv"] = dict(e.conv)
    if g.host is not None:
        out["host"] = {f: getattr(g.host, f) for f in g.host.__dataclass_fields__}
    if g.public is not None:
        out["public"] = g.public.to_dict()
    if g.cpu_threads is not None:
        out["cpu_threads"] = g.cpu_threads
    if g.price is not None:
        out["price"] = g.price.to_dict()
    return out


def gpu_extras_from_dict(d: dict) -> dict:
    """GpuType keyword arguments from gpu_extras_to_dict's output (ValueError if malformed)."""
    out: dict = {}
    if d.get("efficiency"):
        e = d["efficiency"]
        out["efficiency"] = Efficiency(
            compute={str(k): float(v) for k, v in (e.get("compute") or {}).items()},
            conv={str(k): float(v) for k, v in (e.get("conv") or {}).items()},
            memory=None if e.get("memory") is None else float(e["memory"]),
            memory_by_kind={str(k): float(v) for k, v in (e.get("memory_by_kind") or {}).items()},
            size_scale=float(e.get("size_scale", 1.0)),
            inherits=str(e.get("inherits", "")),
            source=str(e.get("source", "")),
        )
    if d.get("host"):
        host: dict[str, Any] = {k: (str(v) if k == "source" else float(v)) for k, v in d["host"].items()}
        out["host"] = HostCosts(**host)
    if d.get("public"):
        try:
            out["public"] = PublicFigures.from_dict(d["public"])
        except KeyError as e:
            raise ValueError(f"public figures lack {e.args[0]!r}") from None
    if d.get("cpu_threads") is not None:
        out["cpu_threads"] = int(d["cpu_threads"])
    if d.get("price") is not None:
        try:
            out["price"] = Price.from_dict(d["price"])
        except KeyError as e:
            raise ValueError(f"price lacks {e.args[0]!r}") from None
    return out
