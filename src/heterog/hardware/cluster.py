"""Cluster: devices grouped into nodes, joined by directional links.

Topology model. Every device has a port to its node's fabric (NVLink or PCIe), one link per
direction; every node has a NIC to the switch, one link per direction; a switch core link
is added when the switch is oversubscribed. A transfer occupies every link on its path, so
transfers that share a NIC contend; up and down directions do not (links are full duplex).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from heterog.errors import ClusterError
from heterog.hardware.gputype import GpuType


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    name: str  # e.g. 'node0/gpu1.up', 'node0.nic.down', 'switch.core'
    kind: str  # 'nvlink', 'pcie', 'nic', 'switch', 'loopback'
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    name: str  # unique, e.g. 'node0/gpu1'
    gpu_type: str  # key into Cluster.gpu_types
    node: str
    slowdown: float = 1.0  # emulated clusters: compute runs this many times slower
    memory_bytes: int | None = None  # override of the type's memory (emulated / partial GPUs)
    price_per_hour: float | None = None  # US dollars; the cluster file's (hardware/prices.py), else the type's


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    name: str
    devices: tuple[str, ...]
    nic_bandwidth_bytes_per_s: float
    nic_latency_s: float
    intra_latency_s: float
    # Speed of the node's host (CPU, Python, PyTorch build) relative to the reference host the
    # catalog's host costs were fitted on (1.0); 0.5 = every host cost takes twice as long.
    # Eager PyTorch on a GPU is host-bound at small batches, so this sets those step times.
    host_speed: float = 1.0

    def __post_init__(self) -> None:
        if not (self.host_speed > 0.0 and math.isfinite(self.host_speed)):
            raise ClusterError(
                f"node {self.name!r}: host_speed must be a finite factor > 0 "
                f"(1.0 = the reference host), found {self.host_speed!r}."
            )


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    kind: str = "real"  # 'real' or 'emulated' (local processes)
    gpu_types: dict[str, GpuType]
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    links: dict[str, Link]
    switch_core: str | None = None  # name of the oversubscribed switch link, if any
    meta: dict[str, Any] = field(default_factory=dict)

    # -- look-ups ------------------------------------------------------------------------
    @cached_property
    def device_index(self) -> dict[str, int]:
        return {d.name: i for i, d in enumerate(self.devices)}

    def device(self, name: str) -> Device:
        try:
            return self.devices[self.device_index[name]]
        except KeyError:
            known = ", ".join(d.name for d in self.devices[:12])
            raise ClusterError(
                f"no device {name!r} in cluster {self.name!r}; devices: {known}"
                f"{' …' if len(self.devices) > 12 else ''}."
            ) from None

    def gpu(self, device: str) -> GpuType:
        return self.gpu_types[self.device(device).gpu_type]

    def price_per_hour(self, device: str) -> float | None:
        """US dollars per hour of `device`: the cluster file's price, else its type's list
        price (catalog.yaml); None when neither gives one."""
        d = self.device(device)
        if d.price_per_hour is not None:
            return d.price_per_hour
        price = self.gpu_types[d.gpu_type].price
        return None if price is None else price.usd_per_hour

    def memory_bytes(self, device: str) -> int:
        d = self.device(device)
        return d.memory_bytes if d.memory_bytes is not None else self.gpu_types[d.gpu_type].memory_bytes

    @cached_property
    def node_of(self) -> dict[str, str]:
        return {d.name: d.node for d in self.devices}

    @cached_property
    def node_index(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def host_speed(self, device: str) -> float:
        """Relative speed of the host that drives `device` (its node's host_speed)."""
        return self.node_index[self.device(device).node].host_speed

    @staticmethod
    def port(device: str, direction: str) -> str:
        return f"{device}.{direction}"

    @staticmethod
    def nic(node: str, direction: str) -> str:
        return f"{node}.nic.{direction}"

    @cached_property
    def _paths(self) -> dict[tuple[str, str], tuple[str, ...]]:
        return {}  # path() per pair, made once: a parameter server's cost walks a path per member

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """Names of the links a transfer from src to dst occupies, in order."""
        hit = self._paths.get((src, dst))
        if hit is not None:
            return hit
        if src == dst:
            return ()
        a, b = self.node_of[src], self.node_of[dst]
        if a == b:
            hit = (self.port(src, "up"), self.port(dst, "down"))
        else:
            core = (self.switch_core,) if self.switch_core else ()
            hit = (self.port(src, "up"), self.nic(a, "up"), *core, self.nic(b, "down"), self.port(dst, "down"))
        self._paths[(src, dst)] = hit
        return hit

    def bottleneck_bandwidth_bytes_per_s(self, src: str, dst: str) -> float:
        return min((self.links[link].bandwidth_bytes_per_s for link in self.path(src, dst)), default=float("inf"))

    def latency_s(self, src: str, dst: str) -> float:
        return sum(self.links[link].latency_s for link in self.path(src, dst))

    def fingerprint(self) -> str:
        body = {
            "devices": [[d.name, d.gpu_type, d.node, d.slowdown, d.memory_bytes] for d in self.devices],
            "links": sorted([link.name, link.bandwidth_bytes_per_s, link.latency_s] for link in self.links.values()),
        }
        # only when set, so clusters without host speeds keep their fingerprints
        speeds = {n.name: n.host_speed for n in self.nodes if n.host_speed != 1.0}
        if speeds:
            body["host_speed"] = speeds
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def build_cluster(
    *,
    name: str,
    gpu_types: dict[str, GpuType],
    nodes: list[dict[str, Any]],
    kind: str = "real",
    switch_core_bandwidth_bytes_per_s: float | None = None,
    switch_latency_s: float = 0.0,
    meta: dict[str, Any] | None = None,
) -> Cluster:
    """Make a Cluster and its links from plain node descriptions.

    Each node dict: name, devices (list of dicts: name, gpu_type, slowdown?, memory_bytes?,
    intra_bandwidth_bytes_per_s?, price_per_hour?), nic_bandwidth_bytes_per_s, nic_latency_s, intra_latency_s,
    host_speed? (1.0).
    The YAML loader (hardware.spec) validates user input and calls this.
    """
    links: dict[str, Link] = {}
    devices: list[Device] = []
    node_objs: list[Node] = []
    for n in nodes:
        names = []
        for d in n["devices"]:
            gt = gpu_types[d["gpu_type"]]
            dev = Device(
                name=d["name"],
                gpu_type=d["gpu_type"],
                node=n["name"],
                slowdown=d.get("slowdown", 1.0),
                memory_bytes=d.get("memory_bytes"),
                price_per_hour=d.get("price_per_hour"),
            )
            devices.append(dev)
            names.append(dev.name)
            bw = d.get("intra_bandwidth_bytes_per_s") or gt.intra_node_bandwidth_bytes_per_s
            link_kind = (
                "nvlink" if gt.intra_node_link.startswith("nvlink") else ("loopback" if gt.vendor == "cpu" else "pcie")
            )
            for direction in ("up", "down"):
                ln = Cluster.port(dev.name, direction)
                links[ln] = Link(name=ln, kind=link_kind, bandwidth_bytes_per_s=bw, latency_s=n["intra_latency_s"] / 2)
        for direction in ("up", "down"):
            ln = Cluster.nic(n["name"], direction)
            links[ln] = Link(
                name=ln,
                kind="nic",
                bandwidth_bytes_per_s=n["nic_bandwidth_bytes_per_s"],
                latency_s=n["nic_latency_s"] / 2,
            )
        node_objs.append(
            Node(
                name=n["name"],
                devices=tuple(names),
                nic_bandwidth_bytes_per_s=n["nic_bandwidth_bytes_per_s"],
                nic_latency_s=n["nic_latency_s"],
                intra_latency_s=n["intra_latency_s"],
                host_speed=float(n.get("host_speed", 1.0)),
            )
        )
    core = None
    if switch_core_bandwidth_bytes_per_s is not None:
        core = "switch.core"
        links[core] = Link(
            name=core,
            kind="switch",
            bandwidth_bytes_per_s=switch_core_bandwidth_bytes_per_s,
            latency_s=switch_latency_s,
        )
    return Cluster(
        name=name,
        kind=kind,
        gpu_types=dict(gpu_types),
        nodes=tuple(node_objs),
        devices=tuple(devices),
        links=links,
        switch_core=core,
        meta=meta or {},
    )
