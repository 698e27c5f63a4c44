"""Synthetic search problems: layered graphs, small clusters and a table cost model.

The GNN policy is trained on these (many distinct problems in seconds, no capture needed),
and the search's tests use them as inputs with known answers. `TableCostModel` implements
the CostModel protocol (cost/model.py) with a plain roofline: time = max(FLOPs / (peak ×
efficiency / slowdown), bytes / memory bandwidth) + a per-kernel overhead; transfers are
alpha–beta over the cluster's bottleneck link; a ring all-reduce moves 2(n−1)/n of the buffer
(Patarasuk & Yuan 2009); a parameter server moves n buffers through the server's link.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from heterog.hardware.cluster import Cluster, build_cluster
from heterog.hardware.gputype import GpuType
from heterog.ir.affine import Affine
from heterog.ir.kinds import Phase, SyncMethod
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode

GIB = 2**30
KERNEL_OVERHEAD_S = 5e-6
COMPUTE_EFFICIENCY = 0.5


def gpu_type(
    name: str, tflops: float, memory_gib: float, *, membw_gbs: float = 900.0, intra_gbs: float = 12.0
) -> GpuType:
    """A made-up GPU type for synthetic clusters (not a catalog entry)."""
    peak = tflops * 1e12
    return GpuType(
        name=name,
        vendor="nvidia",
        peak_flops_per_s={"fp32": peak, "tf32": peak, "fp16": 4 * peak, "bf16": 4 * peak},
        memory_bandwidth_bytes_per_s=membw_gbs * 1e9,
        memory_bytes=int(memory_gib * GIB),
        intra_node_link="pcie3",
        intra_node_bandwidth_bytes_per_s=intra_gbs * 1e9,
        sources={"all": "synthetic"},
    )


def toy_cluster(
    speeds_tflops: Sequence[float],
    *,
    memory_gib: Sequence[float] | float = 16.0,
    devices_per_node: int = 1,
    nic_gbs: float = 10.0,
    name: str = "toy",
) -> Cluster:
    """One device per speed; `devices_per_node` devices share a node (and its NIC)."""
    mems = [memory_gib] * len(speeds_tflops) if isinstance(memory_gib, (int, float)) else list(memory_gib)
    assert len(mems) == len(speeds_tflops)
    types: dict[str, GpuType] = {}
    nodes: list[dict] = []
    for i, (tf, mem) in enumerate(zip(speeds_tflops, mems)):
        tname = f"synth-{tf:g}tf-{mem:g}g"
        types.setdefault(tname, gpu_type(tname, tf, mem))
        k = i // devices_per_node
        if len(nodes) <= k:
            nodes.append(
                {
                    "name": f"n{k}",
                    "devices": [],
                    "nic_bandwidth_bytes_per_s": nic_gbs * 1e9,
                    "nic_latency_s": 10e-6,
                    "intra_latency_s": 4e-6,
                }
            )
        nodes[k]["devices"].append({"name": f"n{k}/d{i}", "gpu_type": tname})
    return build_cluster(name=name, gpu_types=types, nodes=nodes)


def layered_graph(
    layers: Sequence[tuple[float, float, float]], *, batch_size: int = 32, name: str = "synthetic", skip_every: int = 0
) -> OpGraph:
    """A chain of layers, each (GFLOP per sample forward, parameter MB, activation MB per sample).

    Backward costs 2× forward (Kaplan et al. 2020). With skip_every=k, every k-th layer also
    feeds the one two ahead (a residual), so the graph is a DAG, not only a chain.
    """
    nodes, edges = [], []
    for i, (gflop, param_mb, act_mb) in enumerate(layers):
        f = gflop * 1e9
        pbytes = int(param_mb * 1e6)
        act = act_mb * 1e6
        nodes.append(
            OpNode(
                name=f"layer{i}",
                module_path=f"layer{i}",
                module_type="Linear",
                kind="matmul",
                fwd_flops=Affine(0.0, f),
                bwd_flops=Affine(0.0, 2 * f),
                fwd_bytes=Affine(2.0 * pbytes, 2 * act),
                bwd_bytes=Affine(3.0 * pbytes, 4 * act),
                saved_bytes=Affine(0.0, act),
                output_bytes=Affine(0.0, act),
                workspace_bytes=Affine(0.0, act),
                param_names=(f"layer{i}.weight",) if pbytes else (),
                param_count=pbytes // 4,
                param_bytes=pbytes,
                fwd_kernels=2,
                bwd_kernels=4,
                tensor_core_flops_fraction=0.9,
            )
        )
        if i:
            edges.append(OpEdge(src=f"layer{i - 1}", dst=f"layer{i}", bytes=Affine(0.0, layers[i - 1][2] * 1e6)))
        if skip_every and i >= 2 and i % skip_every == 0:
            edges.append(OpEdge(src=f"layer{i - 2}", dst=f"layer{i}", bytes=Affine(0.0, layers[i - 2][2] * 1e6)))
    return OpGraph(
        model=name,
        batch_size=batch_size,
        nodes=tuple(nodes),
        edges=tuple(edges),
        input_bytes=Affine(0.0, layers[0][2] * 1e6),
        num_parameters=sum(n.param_count for n in nodes),
    ).validate()


def random_graph(rng: random.Random, *, batch_size: int = 32) -> OpGraph:
    """A random layered model: CNN-like (activation-heavy, few parameters early, a big FC head)
    or transformer-like (uniform blocks), 12–48 layers."""
    n = rng.randint(12, 48)
    if rng.random() < 0.5:  # CNN-like
        layers = []
        for i in range(n):
            depth = i / n
            layers.append(
                (
                    rng.uniform(0.2, 1.5),
                    rng.uniform(0.05, 4.0) * (1 + 8 * depth),
                    rng.uniform(0.2, 3.0) * (1.0 - 0.8 * depth),
                )
            )
        for _ in range(rng.randint(0, 3)):  # fully connected head: parameter heavy, cheap
            layers.append((rng.uniform(0.05, 0.3), rng.uniform(50, 400), 0.02))
    else:
        width = rng.uniform(0.5, 3.0)
        layers = [(rng.uniform(0.8, 1.2) * width, rng.uniform(20, 60) * width, rng.uniform(0.5, 2.0)) for _ in range(n)]
    return layered_graph(layers, batch_size=batch_size, name="random", skip_every=rng.choice([0, 2, 3]))


def random_cluster(rng: random.Random, *, max_devices: int = 8) -> Cluster:
    """2..max_devices devices drawn from three speed/memory classes, 1–4 per node."""
    kinds = [(15.7, 16.0), (11.3, 11.0), (9.3, 12.0), (30.0, 40.0), (5.0, 8.0)]
    chosen = rng.sample(kinds, k=rng.randint(1, 3))
    n = rng.randint(2, max_devices)
    devs = [rng.choice(chosen) for _ in range(n)]
    return toy_cluster(
        [d[0] for d in devs],
        memory_gib=[d[1] for d in devs],
        devices_per_node=rng.choice([1, 2, 4]),
        nic_gbs=rng.choice([3.0, 6.25, 12.5]),
        name="random",
    )


@dataclass(kw_only=True)
class TableCostModel:
    """A roofline CostModel over a graph and cluster, for synthetic problems and tests."""

    graph: OpGraph
    cluster: Cluster
    precision: str = "fp32"
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        self._node = {n.name: n for n in self.graph.nodes}
        self._edge = {(e.src, e.dst): e.bytes for e in self.graph.edges}

    def compute_time_s(self, node: str, device: str, batch: float, phase: Phase) -> float:
        if batch <= 0:
            return 0.0
        n = self._node[node]
        gt = self.cluster.gpu(device)
        dev = self.cluster.device(device)
        flops = (n.fwd_flops if phase == Phase.FORWARD else n.bwd_flops).at(batch)
        nbytes = (n.fwd_bytes if phase == Phase.FORWARD else n.bwd_bytes).at(batch)
        peak = gt.peak_flops_per_s["fp32" if self.precision == "fp32" else "bf16"] * COMPUTE_EFFICIENCY
        t = max(flops / peak, nbytes / gt.memory_bandwidth_bytes_per_s)
        kernels = n.fwd_kernels if phase == Phase.FORWARD else n.bwd_kernels
        return (t + kernels * KERNEL_OVERHEAD_S) * dev.slowdown

    def optimizer_time_s(self, nodes: Sequence[str], device: str) -> float:
        pbytes = sum(self._node[n].param_bytes for n in nodes)
        passes = 3 if self.optimizer == "sgd" else 7  # bytes touched per parameter byte
        return pbytes * passes / self.cluster.gpu(device).memory_bandwidth_bytes_per_s

    def accumulate_time_s(self, nodes: Sequence[str], device: str) -> float:
        pbytes = sum(self._node[n].param_bytes for n in nodes)
        return 3 * pbytes / self.cluster.gpu(device).memory_bandwidth_bytes_per_s * self.cluster.device(device).slowdown

    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        if src == dst or nbytes <= 0:
            return 0.0
        return self.cluster.latency_s(src, dst) + nbytes / self.cluster.bottleneck_bandwidth_bytes_per_s(src, dst)

    def _ring_bandwidth(self, devices: Sequence[str]) -> tuple[float, float]:
        ring = list(devices)
        bw = min(self.cluster.bottleneck_bandwidth_bytes_per_s(a, b) for a, b in zip(ring, ring[1:] + ring[:1]))
        lat = max(self.cluster.latency_s(a, b) for a, b in zip(ring, ring[1:] + ring[:1]))
        return bw, lat

    def collective_time_s(self, op: str, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING) -> float:
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self._ring_bandwidth(devices)
        factor = 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n
        steps = 2 * (n - 1) if method == SyncMethod.RING else 2 * max(1, (n - 1).bit_length())
        return steps * lat + factor * nbytes / bw

    def shard_collective_time_s(
        self, op: str, nbytes: float, devices: Sequence[str], fractions: Sequence[float]
    ) -> float:
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self._ring_bandwidth(devices)
        return (n - 1) * (lat + max(fractions) * nbytes / bw)  # each step waits for the largest piece

    def ps_sync_time_s(self, nbytes: float, devices: Sequence[str], server: str) -> float:
        others = [d for d in devices if d != server]
        if not others or nbytes <= 0:
            return 0.0
        bw = min(self.cluster.bottleneck_bandwidth_bytes_per_s(d, server) for d in others)
        # every other replica pushes its gradient and pulls the parameters through the server's port
        return 2 * (self.cluster.latency_s(others[0], server) + len(others) * nbytes / bw)

    def persistent_bytes(self, nodes: Sequence[str], device: str) -> float:
        pbytes = sum(self._node[n].param_bytes for n in nodes)
        return pbytes * (2 if self.optimizer == "sgd" else 4)  # params + grads (+ Adam m, v)

    def optimizer_state_bytes(self, nodes: Sequence[str], device: str) -> float:
        return sum(self._node[n].param_bytes for n in nodes) * (0 if self.optimizer == "sgd" else 2)

    def activation_bytes(self, nodes: Sequence[str], batch: float, recompute: bool = False) -> float:
        if recompute:  # only each group's input is kept; approximated by the first node's output
            return self._node[nodes[0]].output_bytes.at(batch) if nodes else 0.0
        return sum(self._node[n].saved_bytes.at(batch) for n in nodes)

    def workspace_bytes(self, nodes: Sequence[str], batch: float) -> float:
        return max((self._node[n].workspace_bytes.at(batch) for n in nodes), default=0.0)

    def gradient_bytes(self, nodes: Sequence[str]) -> float:
        return float(sum(self._node[n].param_bytes for n in nodes))

    def recompute_transient_bytes(self, nodes: Sequence[str], batch: float) -> float:
        # no blocks here: the whole group lives again while its backward runs
        return self.activation_bytes(nodes, batch, False)

    def tied_copy_bytes(self, param_bytes: float, device: str) -> float:
        return param_bytes * (2 if self.optimizer == "sgd" else 4)  # as persistent_bytes counts a parameter

    def activation_transfer_bytes(self, src: str, dst: str, batch: float) -> float:
        e = self._edge.get((src, dst))
        return e.at(batch) if e is not None else 0.0
