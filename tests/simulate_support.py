"""Fixtures for the simulator tests: synthetic graphs, clusters, and a table cost model whose
every answer is a closed form, so expected iteration times can be written by hand."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from heterog.hardware.cluster import Cluster, build_cluster
from heterog.hardware.gputype import GpuType
from heterog.ir.affine import Affine
from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode
from heterog.ir.plan import Group, ModelSpec, Plan, Replica

GIB = 2**30


def gpu(name: str = "T", flops: float = 1e12, memory_bytes: int = 16 * GIB, intra_bandwidth: float = 10e9) -> GpuType:
    return GpuType(
        name=name,
        vendor="nvidia",
        peak_flops_per_s={"fp32": flops},
        memory_bandwidth_bytes_per_s=1e12,
        memory_bytes=memory_bytes,
        intra_node_link="pcie3",
        intra_node_bandwidth_bytes_per_s=intra_bandwidth,
    )


def cluster(
    nodes: Sequence[Sequence[float]],
    *,
    nic_bandwidth: float = 1e9,
    latency_s: float = 0.0,
    memory_bytes: int = 16 * GIB,
    intra_bandwidth: float = 10e9,
    name: str = "test",
    core_bandwidth: float | None = None,
) -> Cluster:
    """nodes[k] = FLOP/s of each device on node k; devices are named 'n{k}/d{i}';
    core_bandwidth: an oversubscribed switch core every inter-node transfer crosses."""
    types: dict[str, GpuType] = {}
    specs = []
    i = 0
    for k, speeds in enumerate(nodes):
        devs = []
        for f in speeds:
            tname = f"T{f:g}"
            types.setdefault(tname, gpu(tname, f, memory_bytes, intra_bandwidth))
            devs.append({"name": f"n{k}/d{i}", "gpu_type": tname})
            i += 1
        specs.append(
            {
                "name": f"n{k}",
                "devices": devs,
                "nic_bandwidth_bytes_per_s": nic_bandwidth,
                "nic_latency_s": latency_s,
                "intra_latency_s": latency_s,
            }
        )
    return build_cluster(name=name, gpu_types=types, nodes=specs, switch_core_bandwidth_bytes_per_s=core_bandwidth)


def with_link_bandwidth(c: Cluster, link: str, bandwidth: float) -> Cluster:
    links = dict(c.links)
    links[link] = dataclasses.replace(links[link], bandwidth_bytes_per_s=bandwidth)
    return dataclasses.replace(c, links=links)


def node(
    name: str,
    fwd_flops_per_sample: float,
    *,
    param_bytes: int = 0,
    saved_per_sample: float = 0.0,
    workspace_per_sample: float = 0.0,
    out_per_sample: float = 0.0,
) -> OpNode:
    return OpNode(
        name=name,
        module_path=name,
        module_type="Linear",
        kind="matmul",
        fwd_flops=Affine(0, fwd_flops_per_sample),
        bwd_flops=Affine(0, 2 * fwd_flops_per_sample),
        saved_bytes=Affine(0, saved_per_sample),
        workspace_bytes=Affine(0, workspace_per_sample),
        output_bytes=Affine(0, out_per_sample),
        param_bytes=param_bytes,
        param_count=param_bytes // 4,
        param_names=(f"{name}.weight",) if param_bytes else (),
    )


def chain_graph(
    n: int,
    *,
    flops: float = 1e9,
    param_bytes: int = 4_000_000,
    saved: float = 1e6,
    edge_bytes: float = 1e5,
    batch_size: int = 8,
) -> OpGraph:
    nodes = tuple(
        node(f"l{i}", flops, param_bytes=param_bytes, saved_per_sample=saved, out_per_sample=edge_bytes)
        for i in range(n)
    )
    edges = tuple(OpEdge(src=f"l{i}", dst=f"l{i + 1}", bytes=Affine(0, edge_bytes)) for i in range(n - 1))
    return OpGraph(model="chain", batch_size=batch_size, nodes=nodes, edges=edges).validate()


def graph(nodes: Sequence[OpNode], edges: Sequence[tuple[str, str, float]], batch_size: int = 8) -> OpGraph:
    return OpGraph(
        model="custom",
        batch_size=batch_size,
        nodes=tuple(nodes),
        edges=tuple(OpEdge(src=a, dst=b, bytes=Affine(0, x)) for a, b, x in edges),
    ).validate()


def plan(
    groups: Sequence[tuple[str, Sequence[str], Sequence[tuple[str, float]]]],
    *,
    batch_size: int = 8,
    sync: str = "ring",
    **kw,
) -> Plan:
    """groups: (name, nodes, [(device, share), ...]); replicated groups get `sync`."""
    gs = tuple(
        Group(
            name=n,
            nodes=tuple(ns),
            replicas=tuple(Replica(device=d, share=s) for d, s in reps),
            sync=sync if len(reps) > 1 else "none",
        )
        for n, ns, reps in groups
    )
    return Plan(strategy="test", model=ModelSpec(name="chain", batch_size=batch_size), groups=gs, **kw)


class TableCosts:
    """Closed-form CostModel: node time = FLOPs / device FLOP/s (× slowdown); transfers
    latency + bytes / bottleneck; ring all-reduce 2(n−1)/n · bytes / slowest hop; PS 2·n·bytes /
    server bottleneck; persistent = 2 × parameter bytes (weights + gradients, SGD)."""

    precision = "fp32"
    optimizer = "sgd"

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        optimizer_s_per_byte: float = 1e-9,
        accumulate_s_per_byte: float = 0.0,
    ):
        self.g = graph
        self.c = cluster
        self.opt = optimizer_s_per_byte
        self.acc = accumulate_s_per_byte
        self.edges = {(e.src, e.dst): e.bytes for e in graph.edges}

    def rate(self, device: str) -> float:
        return self.c.gpu(device).peak_flops_per_s["fp32"] / self.c.device(device).slowdown

    def compute_time_s(self, node, device, batch, phase):
        n = self.g.node(node)
        return (n.fwd_flops if phase == Phase.FORWARD else n.bwd_flops).at(batch) / self.rate(device)

    def optimizer_time_s(self, nodes, device):
        return self.opt * sum(self.g.node(n).param_bytes for n in nodes)

    def accumulate_time_s(self, nodes, device):  # 0 unless asked: most hand-worked schedules leave it out
        return self.acc * sum(self.g.node(n).param_bytes for n in nodes)

    def transfer_time_s(self, nbytes, src, dst):
        return self.c.latency_s(src, dst) + nbytes / self.c.bottleneck_bandwidth_bytes_per_s(src, dst)

    def ring_order(self, devices):
        return sorted(devices, key=lambda d: (self.c.node_of[d], self.c.device_index[d]))

    def collective_time_s(self, op, nbytes, devices, method="ring"):
        n = len(devices)
        if n <= 1:
            return 0.0
        order = self.ring_order(devices)
        bw = min(self.c.bottleneck_bandwidth_bytes_per_s(order[i], order[(i + 1) % n]) for i in range(n))
        return 2 * (n - 1) / n * nbytes / bw

    def shard_collective_time_s(self, op, nbytes, devices, fractions):
        n = len(devices)
        if n <= 1:
            return 0.0
        order = self.ring_order(devices)
        bw = min(self.c.bottleneck_bandwidth_bytes_per_s(order[i], order[(i + 1) % n]) for i in range(n))
        return (n - 1) * max(fractions) * nbytes / bw  # every step waits for the largest piece

    def ps_sync_time_s(self, nbytes, devices, server):
        others = [d for d in devices if d != server]
        if not others:
            return 0.0
        bw = min(self.c.bottleneck_bandwidth_bytes_per_s(d, server) for d in others)
        return 2 * len(others) * nbytes / bw

    def persistent_bytes(self, nodes, device):
        return 2.0 * sum(self.g.node(n).param_bytes for n in nodes)

    def optimizer_state_bytes(self, nodes, device):
        return 0.0  # plain SGD: parameters and gradients only

    def activation_bytes(self, nodes, batch, recompute=False):
        if recompute:
            return self.g.node(nodes[0]).output_bytes.at(batch)
        return sum(self.g.node(n).saved_bytes.at(batch) for n in nodes)

    def workspace_bytes(self, nodes, batch):
        return max((self.g.node(n).workspace_bytes.at(batch) for n in nodes), default=0.0)

    def gradient_bytes(self, nodes):
        return float(sum(self.g.node(n).param_bytes for n in nodes))

    def activation_transfer_bytes(self, src, dst, batch):
        e = self.edges.get((src, dst))
        return e.at(batch) if e is not None else 0.0
