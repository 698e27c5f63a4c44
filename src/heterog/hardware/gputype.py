"""The facts about one kind of accelerator that the cost model needs. The table of known
types is data (catalog.yaml), each figure with its public source."""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuType:
    name: str                                   # e.g. 'A100-80GB'
    vendor: str                                 # 'nvidia', 'amd', 'cpu'
    peak_flops_per_s: dict[str, float]          # dense, per precision in PRECISIONS (0 = unsupported)
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    intra_node_link: str                        # 'nvlink3', 'pcie3', ...
    intra_node_bandwidth_bytes_per_s: float     # per direction, per device
    sources: dict[str, str] = field(default_factory=dict)  # figure → public source

    def __post_init__(self) -> None:
        for p in PRECISIONS:
            if self.peak_flops_per_s.get(p, 0.0) < 0:
                raise ValueError(f"GPU type {self.name}: peak_flops_per_s[{p}] must be ≥ 0.")
        if self.memory_bandwidth_bytes_per_s <= 0 or self.memory_bytes <= 0:
            raise ValueError(f"GPU type {self.name}: memory bandwidth and size must be positive.")
