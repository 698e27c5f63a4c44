"""What the lowering memoises per (graph, cost model): `CostTable`, the cost model's answers
per group, and `LoweringCaches`, one named cache per piece the lowering derives, with the rule
that keeps them consistent.

The search lowers thousands of neighbouring plans against one CostTable; most blocks, moves
and buckets recur between them, so each module keeps what it derives here instead of
recomputing it. Entries that depend on the merged-device map (which symmetric devices are
simulated once) are keyed by a small int for it (`rep_id`): hashing a 1024-entry tuple per
block cost more than the caches saved. Those ints restart when too many maps were seen, and
every cache keyed by them is emptied at that moment, in `rep_id` — the one invalidation rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from heterog.cost import comm
from heterog.ir.kinds import Phase, SyncMethod
from heterog.ir.opgraph import OpGraph

_MAX_ENTRIES = 500_000  # entries in one cost table before it is cleared
MAX_REP_IDS = 10_000  # merged-device maps numbered before the numbers restart


@dataclass(slots=True)
class LoweringCaches:
    """Per-CostTable caches of the lowering (lower/*.py), each named for what it holds."""

    # keyed by rep_id: emptied whenever the numbers restart
    columns: dict[Any, Any] = field(default_factory=dict)  # tasks.py: a block's compute columns
    kept: dict[Any, Any] = field(default_factory=dict)  # columns.py: replicas a block keeps per placement
    buckets: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: a bucket's sync
    moves: dict[Any, Any] = field(default_factory=dict)  # transfers.py: a pair of blocks' moves and templates
    # keyed by the plan's own values
    replica: dict[Any, Any] = field(default_factory=dict)  # tasks.py: per-replica columns of a block
    splits: dict[Any, Any] = field(default_factory=dict)  # tasks.py: (size, placement) → samples per replica
    state: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: (nodes, served) → class → state
    classes: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: device set → its devices' classes
    block_edges: dict[Any, Any] = field(default_factory=dict)  # blocks.py: a grouping's bytes between blocks
    p2p_pairs: dict[int, dict[Any, Any]] = field(default_factory=dict)  # blocks.py: per ClusterInfo (its id)
    _rep_ids: dict[tuple[int, ...], int] = field(default_factory=dict)

    def rep_id(self, rep: list[int]) -> int:
        """The number of the merged-device map `rep` (device → the device simulated for it)."""
        key = tuple(rep)
        hit = self._rep_ids.get(key)
        if hit is None:
            if len(self._rep_ids) >= MAX_REP_IDS:  # numbers restart: drop every entry keyed by an old one
                self._rep_ids.clear()
                for cache in (self.columns, self.kept, self.buckets, self.moves):
                    cache.clear()
            hit = self._rep_ids[key] = len(self._rep_ids)
        return hit


class CostTable:
    """Cost-model answers per group, memoised (the cost model is pure for fixed inputs)."""

    def __init__(self, graph: OpGraph, costs):
        self.graph = graph
        self.costs = costs
        self._time: dict = {}
        self._mem: dict = {}
        self._edge: dict[tuple[str, str], tuple[float, float]] = {}
        self._comm: dict = {}
        self.caches = LoweringCaches()  # what the lowering derives per (graph, costs)
        # optional extension of the CostModel protocol: the sum of compute_time_s over nodes
        self._group_time = getattr(costs, "group_time_s", None)

    def _trim(self) -> None:
        for d in (self._time, self._mem, self._comm):
            if len(d) > _MAX_ENTRIES:
                d.clear()

    def times_s(self, nodes: tuple[str, ...], device: str, samples: int) -> tuple[float, float]:
        """(forward, backward) time of a group's nodes run back to back at `samples`."""
        key = (nodes, device, samples)
        hit = self._time.get(key)
        if hit is None:
            if samples <= 0:
                hit = (0.0, 0.0)
            elif self._group_time is not None:  # a vectorised sum, when the model has one
                gt = self._group_time
                hit = (
                    float(gt(nodes, device, samples, Phase.FORWARD)),
                    float(gt(nodes, device, samples, Phase.BACKWARD)),
                )
            else:
                ct = self.costs.compute_time_s
                hit = (
                    sum(ct(n, device, samples, Phase.FORWARD) for n in nodes),
                    sum(ct(n, device, samples, Phase.BACKWARD) for n in nodes),
                )
            self._trim()
            self._time[key] = hit
        return hit

    def _cached(self, store: dict, key: tuple, make: Callable[[], float]) -> float:
        """store[key], made (and the store trimmed) on the first ask."""
        hit = store.get(key)
        if hit is None:
            hit = make()
            self._trim()
            store[key] = hit
        return hit

    def optimizer_s(self, nodes: tuple[str, ...], device: str) -> float:
        return self._cached(
            self._time, ("opt", nodes, device), lambda: float(self.costs.optimizer_time_s(nodes, device))
        )

    def accumulate_s(self, nodes: tuple[str, ...], device: str) -> float:
        return self._cached(
            self._time, ("acc", nodes, device), lambda: float(self.costs.accumulate_time_s(nodes, device))
        )

    def activation_bytes(self, nodes: tuple[str, ...], samples: int, recompute: bool) -> float:
        return self._cached(
            self._mem,
            ("act", nodes, samples, recompute),
            lambda: 0.0 if samples <= 0 else float(self.costs.activation_bytes(nodes, samples, recompute)),
        )

    def recompute_transient_bytes(self, nodes: tuple[str, ...], samples: int) -> float:
        def make() -> float:
            fn = getattr(self.costs, "recompute_transient_bytes", None)
            if samples <= 0:
                return 0.0
            if fn is None:  # a cost model without blocks: the whole group lives again
                return float(self.costs.activation_bytes(nodes, samples, False))
            return float(fn(nodes, samples))

        return self._cached(self._mem, ("rt", nodes, samples), make)

    def workspace_bytes(self, nodes: tuple[str, ...], samples: int) -> float:
        return self._cached(
            self._mem,
            ("ws", nodes, samples),
            lambda: 0.0 if samples <= 0 else float(self.costs.workspace_bytes(nodes, samples)),
        )

    def persistent_bytes(self, nodes: tuple[str, ...], device: str) -> float:
        return self._cached(
            self._mem, ("pers", nodes, device), lambda: float(self.costs.persistent_bytes(nodes, device))
        )

    def optimizer_state_bytes(self, nodes: tuple[str, ...], device: str) -> float:
        return self._cached(
            self._mem, ("optstate", nodes, device), lambda: float(self.costs.optimizer_state_bytes(nodes, device))
        )

    def gradient_bytes(self, nodes: tuple[str, ...]) -> float:
        return self._cached(self._mem, ("grad", nodes), lambda: float(self.costs.gradient_bytes(nodes)))

    def edge_bytes(self, src: str, dst: str) -> tuple[float, float]:
        """(fixed, per-sample) bytes on edge src → dst; the cost model is affine in the batch."""
        hit = self._edge.get((src, dst))
        if hit is None:
            at0 = float(self.costs.activation_transfer_bytes(src, dst, 0))
            at1 = float(self.costs.activation_transfer_bytes(src, dst, 1))
            hit = self._edge[(src, dst)] = (at0, at1 - at0)
        return hit

    def transfer_line(self, src: str, dst: str) -> tuple[float, float]:
        """(fixed s, s per byte) of a point-to-point transfer src → dst: affine in its bytes
        (the CostModel protocol: latency + bytes / bottleneck bandwidth), so probed twice per
        pair and exact after — a neighbour's re-partition sends new byte counts each time."""
        key = ("p2p", src, dst)
        hit = self._comm.get(key)
        if hit is None:
            self._trim()
            hit = comm.affine_in_bytes(self._comm, key, lambda b: float(self.costs.transfer_time_s(b, src, dst)))
        return hit

    def shard_sync_s(self, op: str, nbytes: float, devices: tuple[str, ...], fractions: tuple[float, ...]) -> float:
        """A ring reduce-scatter or all-gather with uneven pieces (devices[i] owns fractions[i])."""
        return self._cached(
            self._comm,
            (op, nbytes, devices, fractions),
            lambda: float(self.costs.shard_collective_time_s(op, nbytes, devices, fractions)),
        )

    def parameter_bytes(self, nodes: tuple[str, ...], device: str) -> float:
        """The parameters alone: persistent state less gradients and optimizer state."""
        return (
            self.persistent_bytes(nodes, device)
            - self.gradient_bytes(nodes)
            - self.optimizer_state_bytes(nodes, device)
        )

    def sync_s(self, method: str, nbytes: float, devices: tuple[str, ...], server: str | None) -> float:
        def make() -> float:
            if method == SyncMethod.PS:
                return float(self.costs.ps_sync_time_s(nbytes, devices, server))
            return float(self.costs.collective_time_s("allreduce", nbytes, devices, method))

        return self._cached(self._comm, (method, nbytes, devices, server), make)
