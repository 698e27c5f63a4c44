"""The analytic cost model: compute times per node × device type × batch × phase (the
roofline of cost/roofline.py), the memory model, and communication over the cluster —
everything the simulator and the search ask through the CostModel protocol (cost/model.py).
A measured profile (cost/profile.py), when given, replaces the estimate per node.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from heterog.cost import comm
from heterog.cost.memory import OPTIMIZER_STATE_COPIES, MemoryModel
from heterog.cost.profile import Profile
from heterog.cost.roofline import TypeTable
from heterog.errors import ClusterError, PlanError
from heterog.hardware.catalog import host_overheads
from heterog.hardware.cluster import Cluster
from heterog.hardware.efficiency import memory_efficiency
from heterog.ir.kinds import Phase, Precision, SyncMethod
from heterog.ir.opgraph import OpGraph

PRECISIONS = tuple(Precision)
# Optimizer traffic per parameter byte (reads + writes of fp32 tensors) and ops per tensor.
# SGD-momentum: buf.mul_(m).add_(g) (2 + 3), p.add_(buf, -lr) (3).
# AdamW (torch.optim.adamw): p.mul_ (2), exp_avg.lerp_ (3), exp_avg_sq.mul_ (2) .addcmul_ (3),
# sqrt (2), div_ (2), add_ (2), p.addcdiv_ (4).
OPTIMIZER_BYTES_PER_PARAM_BYTE = {"sgd": 8.0, "adamw": 20.0}
OPTIMIZER_OPS_PER_TENSOR = {"sgd": 3, "adamw": 10}
ACCUMULATE_BYTES_PER_PARAM_BYTE = 3.0  # gradient accumulation: read both, write one
OPTIMIZER_TEMPORARIES = {"sgd": 0, "adamw": 2}  # out-of-place parameter-sized results per step
FRESH_PAGE_SHARE = 0.9  # tensors within 10% of the step's largest count as the largest


class AnalyticCostModel:
    """Implements heterog.cost.model.CostModel for one graph, cluster, precision, optimizer."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        precision: str = "fp32",
        optimizer: str = "sgd",
        profile: Profile | None = None,
        recompute: bool = False,
    ):
        if precision not in PRECISIONS:
            raise PlanError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
        self.graph = graph
        self.cluster = cluster
        self.precision = precision
        self.optimizer = optimizer
        self.recompute = recompute
        self.profile = profile
        allocator = "cpu" if all(g.vendor == "cpu" for g in cluster.gpu_types.values()) else "cuda"
        self.memory = MemoryModel(graph, precision=precision, optimizer=optimizer, allocator=allocator)
        self._tables: dict[tuple[str, str], TypeTable] = {}
        self._node_cache: dict[tuple[int, str, float, float, str], float] = {}
        self._index_cache: dict[tuple[str, ...], np.ndarray] = {}
        self._in_block = self.memory.in_block()
        self._edges = {(e.src, e.dst): e.bytes for e in graph.edges}
        self._comm_cache: dict[tuple, tuple[float, float]] = {}
        self._n_tensors = np.array([float(len(n.param_names) or (1 if n.param_count else 0)) for n in graph.nodes])
        if profile is not None:
            profile.check_against(graph)

    # -- helpers ------------------------------------------------------------------------------
    def _table(self, gpu_type: str, phase: Phase) -> TypeTable:
        key = (gpu_type, phase)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = TypeTable(self.graph, self.cluster.gpu_types[gpu_type], self.precision, phase)
        return t

    def _idx(self, nodes: Sequence[str]) -> np.ndarray:
        key = tuple(nodes)
        idx = self._index_cache.get(key)
        if idx is None:
            gi = self.graph.index
            try:
                idx = np.fromiter((gi[n] for n in key), dtype=np.int64, count=len(key))
            except KeyError as e:
                raise PlanError(f"node {e.args[0]!r} is not in the graph of {self.graph.model}.") from None
            self._index_cache[key] = idx
        return idx

    def _device(self, device: str):
        try:
            return self.cluster.device(device)
        except ClusterError:
            raise

    def _host_scale(self, device: str) -> float:
        """How much longer than the reference host this device's host takes per op."""
        return 1.0 / self.cluster.host_speed(device)

    def _phase_times_s(
        self, idx: np.ndarray, gpu_type: str, batch: float, phase: Phase, host_scale: float = 1.0
    ) -> np.ndarray:
        if phase not in (Phase.FORWARD, Phase.BACKWARD):
            raise PlanError(f"unknown phase {phase!r}; use Phase.FORWARD or Phase.BACKWARD (heterog.ir.kinds).")
        times = self._table(gpu_type, phase).times_s(idx, batch, host_scale)
        if self.profile is not None:
            for j, i in enumerate(idx):
                measured = self.profile.time_s(self.graph.nodes[i].name, gpu_type, phase, batch)
                if measured is not None:
                    times[j] = measured
        if phase == Phase.BACKWARD and self.recompute:
            fwd = self._phase_times_s(idx, gpu_type, batch, Phase.FORWARD, host_scale)
            times = times + np.where(self._in_block[idx], fwd, 0.0)
        return times

    # -- compute --------------------------------------------------------------------------------
    def compute_time_s(self, node: str, device: str, batch: float, phase: Phase) -> float:
        if batch <= 0:
            return 0.0
        d = self._device(device)
        i = self.graph.index.get(node)
        if i is None:
            raise PlanError(f"node {node!r} is not in the graph of {self.graph.model}.")
        scale = self._host_scale(device)
        key = (i, d.gpu_type, scale, float(batch), phase)
        t = self._node_cache.get(key)
        if t is None:
            t = self._node_cache[key] = float(self._phase_times_s(np.array([i]), d.gpu_type, batch, phase, scale)[0])
        return t * d.slowdown

    def group_time_s(self, nodes: Sequence[str], device: str, batch: float, phase: Phase) -> float:
        """Sum of compute_time_s over `nodes` (vectorised; the search's hot path)."""
        if batch <= 0 or not nodes:
            return 0.0
        d = self._device(device)
        return (
            float(self._phase_times_s(self._idx(nodes), d.gpu_type, batch, phase, self._host_scale(device)).sum())
            * d.slowdown
        )

    def node_times_s(self, nodes: Sequence[str], device: str, batch: float, phase: Phase) -> np.ndarray:
        """compute_time_s of every node in `nodes`, as an array."""
        if batch <= 0 or not nodes:
            return np.zeros(len(nodes))
        d = self._device(device)
        return self._phase_times_s(self._idx(nodes), d.gpu_type, batch, phase, self._host_scale(device)) * d.slowdown

    def recompute_time_s(self, nodes: Sequence[str], device: str, batch: float) -> float:
        """Extra backward time if `nodes` are recomputed (their block members' forward again);
        already included in 'bwd' times when the model was built with recompute=True."""
        if batch <= 0 or not nodes:
            return 0.0
        d = self._device(device)
        idx = self._idx(nodes)
        fwd = self._table(d.gpu_type, Phase.FORWARD).times_s(idx, batch, self._host_scale(device))
        return float(np.where(self._in_block[idx], fwd, 0.0).sum()) * d.slowdown

    def _parameter_pass(self, nodes: Sequence[str], device: str, bytes_per_param_byte: float):
        """A pass over the parameters of `nodes` on `device` (the optimizer step, a gradient
        accumulation): (their indices, the device, its type, the streaming time at the memory
        rate the optimizer reaches), or None without parameters."""
        idx = self._idx(nodes)
        pbytes = float(self.memory.param_bytes[idx].sum())
        if pbytes <= 0:
            return None
        d = self._device(device)
        gpu = self.cluster.gpu_types[d.gpu_type]
        return (
            idx,
            d,
            gpu,
            bytes_per_param_byte * pbytes / (gpu.memory_bandwidth_bytes_per_s * memory_efficiency(gpu, "optimizer")),
        )

    def optimizer_time_s(self, nodes: Sequence[str], device: str) -> float:
        p = self._parameter_pass(nodes, device, OPTIMIZER_BYTES_PER_PARAM_BYTE[self.optimizer])
        if p is None:
            return 0.0
        idx, d, gpu, traffic_s = p
        oh = host_overheads(gpu)
        tensors = float(self._n_tensors[idx].sum())
        if oh.synchronous:
            # CPU: torch.optim's default is the per-tensor for-loop (foreach is CUDA-only);
            # AdamW's two out-of-place temporaries (sqrt, division) per tensor land on fresh
            # pages when larger than glibc's mmap threshold
            host_s = tensors * OPTIMIZER_OPS_PER_TENSOR[self.optimizer] * oh.dispatch_s
            # In the optimizer step, after the activations are freed, the largest parameter's
            # temporaries are the largest blocks: glibc's threshold (raised to the largest
            # block freed, at most 32 MiB) sends them, and those near their size, to fresh pages.
            per_node = self.memory.param_bytes[idx]
            big = min(oh.fresh_threshold_bytes, FRESH_PAGE_SHARE * float(self.memory.param_bytes.max(initial=0.0)))
            fresh_s = (
                OPTIMIZER_TEMPORARIES[self.optimizer]
                * oh.fresh_page_s_per_byte
                * float(per_node[per_node >= big].sum())
            )
            return (traffic_s + host_s + fresh_s) * d.slowdown
        # GPU: foreach kernels; host cost per tensor overlaps the device's streaming
        return max(traffic_s, tensors * oh.optimizer_per_tensor_s * self._host_scale(device)) * d.slowdown

    def accumulate_time_s(self, nodes: Sequence[str], device: str) -> float:
        """autograd's AccumulateGrad: `grad += new` per parameter, reading two and writing one
        parameter-sized tensor, one op per tensor. On this CPU a pipeline stage holding most of
        the toy CNN's 16.5 MB of parameters paid a few ms per micro-batch for it, ~0.2 s a GPipe
        step of 16 micro-batches on a 3×-paced device that the profile (one backward per step)
        did not see."""
        p = self._parameter_pass(nodes, device, ACCUMULATE_BYTES_PER_PARAM_BYTE)
        if p is None:
            return 0.0
        idx, d, gpu, traffic_s = p
        if host_overheads(gpu).synchronous:
            return (traffic_s + float(self._n_tensors[idx].sum()) * host_overheads(gpu).dispatch_s) * d.slowdown
        return traffic_s * d.slowdown

    # -- communication ---------------------------------------------------------------------------
    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        return comm.p2p_time_s(self.cluster, nbytes, src, dst)

    def collective_time_s(self, op: str, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING) -> float:
        return comm.cached_collective_time_s(self._comm_cache, self.cluster, op, nbytes, devices, method)

    def shard_collective_time_s(
        self, op: str, nbytes: float, devices: Sequence[str], fractions: Sequence[float]
    ) -> float:
        return comm.cached_shard_collective_time_s(self._comm_cache, self.cluster, op, nbytes, devices, fractions)

    def ps_sync_time_s(self, nbytes: float, devices: Sequence[str], server: str) -> float:
        return comm.cached_ps_sync_time_s(self._comm_cache, self.cluster, nbytes, devices, server)

    # -- memory ----------------------------------------------------------------------------------
    def persistent_bytes(self, nodes: Sequence[str], device: str) -> float:
        self._device(device)
        return self.memory.persistent_bytes(self._idx(nodes))

    def optimizer_state_bytes(self, nodes: Sequence[str], device: str) -> float:
        self._device(device)
        return self.memory.optimizer_state_bytes(self._idx(nodes))

    def tied_copy_bytes(self, param_bytes: float, device: str) -> float:
        self._device(device)
        return (2 + OPTIMIZER_STATE_COPIES[self.optimizer]) * float(param_bytes)

    def activation_bytes(self, nodes: Sequence[str], batch: float, recompute: bool = False) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.saved_bytes(self._idx(nodes), batch, recompute or self.recompute)

    def recompute_transient_bytes(self, nodes: Sequence[str], batch: float) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.recompute_transient_bytes(self._idx(nodes), batch)

    def workspace_bytes(self, nodes: Sequence[str], batch: float) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.workspace_bytes(self._idx(nodes), batch)

    def gradient_bytes(self, nodes: Sequence[str]) -> float:
        return self.memory.grads_bytes(self._idx(nodes))

    def activation_transfer_bytes(self, src: str, dst: str, batch: float) -> float:
        b = self._edges.get((src, dst))
        if b is None or batch <= 0:
            return 0.0
        return b.at(batch) * self.memory.dtypes.out[self.graph.index[src]]
