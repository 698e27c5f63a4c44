"""The interface between costs and their consumers (simulator, search, predict).

`CostModel` is what the simulator and the search call; the analytic roofline model
(cost.analytic) and measured profiles implement it. Times are uncontended: the simulator
adds contention by occupying the links named by `Cluster.path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from heterog.ir.kinds import Phase, SyncMethod

Collective = Literal["allreduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


class CostModel(Protocol):
    precision: str  # 'fp32' | 'amp-bf16' | 'fp16'
    optimizer: str  # 'sgd' | 'adamw'

    def compute_time_s(self, node: str, device: str, batch: float, phase: Phase) -> float:
        """Time of one node's forward or backward on `device` for `batch` samples (0 → 0)."""
        ...

    def optimizer_time_s(self, nodes: Sequence[str], device: str) -> float:
        """Time of the optimizer step over the parameters of `nodes` on `device`."""
        ...

    def accumulate_time_s(self, nodes: Sequence[str], device: str) -> float:
        """Time to add one micro-batch's parameter gradients of `nodes` into those already
        held on `device`: every backward after a step's first (the first creates them)."""
        ...

    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        """Point-to-point time over the real path: latency + bytes / bottleneck bandwidth."""
        ...

    def collective_time_s(
        self, op: Collective, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING
    ) -> float:
        """A collective over `devices` ('ring', 'tree', 'hierarchical'), limited by the
        slowest link it crosses. nbytes is the full buffer size on each member."""
        ...

    def shard_collective_time_s(
        self, op: Collective, nbytes: float, devices: Sequence[str], fractions: Sequence[float]
    ) -> float:
        """A ring 'reduce_scatter' or 'all_gather' of a buffer of nbytes over `devices`, the
        member devices[i] owning the fraction fractions[i] of it (sharded state: uneven
        pieces), limited by the slowest link each step crosses."""
        ...

    def ps_sync_time_s(self, nbytes: float, devices: Sequence[str], server: str) -> float:
        """Parameter server: every replica sends its gradient to `server`, which sums and
        sends the parameters back; limited by the server's links."""
        ...

    # -- memory (bytes) ----------------------------------------------------------------------
    def persistent_bytes(self, nodes: Sequence[str], device: str) -> float:
        """Parameters + gradients + optimizer state of `nodes` held on one replica."""
        ...

    def optimizer_state_bytes(self, nodes: Sequence[str], device: str) -> float:
        """The optimizer state part of persistent_bytes: what the replicas of a group synced
        by a parameter server do not hold (the server keeps it and applies the update)."""
        ...

    def activation_bytes(self, nodes: Sequence[str], batch: float, recompute: bool = False) -> float:
        """Activations saved for backward by `nodes` at `batch` samples."""
        ...

    def recompute_transient_bytes(self, nodes: Sequence[str], batch: float) -> float:
        """With recompute, the activations rebuilt during one block's backward (the largest
        block among `nodes`); activation_bytes(recompute=True) excludes them."""
        ...

    def workspace_bytes(self, nodes: Sequence[str], batch: float) -> float:
        """Largest transient buffer while any of `nodes` runs."""
        ...

    def gradient_bytes(self, nodes: Sequence[str]) -> float:
        """Bytes of the gradients of `nodes` as synchronised (in the gradient dtype)."""
        ...

    def tied_copy_bytes(self, param_bytes: float, device: str) -> float:
        """A copy of a tied parameter of `param_bytes` held on `device` besides its owner's:
        the parameter, its gradient and its optimizer state."""
        ...

    def activation_transfer_bytes(self, src: str, dst: str, batch: float) -> float:
        """Bytes on the graph edge src → dst for `batch` samples (0 if no edge)."""
        ...
