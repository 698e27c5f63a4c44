"""What a GPU type's PCIe port carries in collectives and transfers, where a data sheet's
link rate is not what NCCL reaches.

The catalog gives each type the nominal rate of its intra-node link (a T4: PCIe Gen3 x16,
15.75 GB/s per direction). On servers whose GPUs meet only through the CPU's PCIe host bridge
(`nvidia-smi topo -m` PHB between every pair, as on AWS g4dn.12xlarge's four T4s) every ring
step goes through the CPU — peer-to-peer across the host bridge (NCCL_P2P_LEVEL=PHB: "traffic
will go through the CPU", NCCL's documentation) or staged through host memory by NCCL's SHM
transport where peer-to-peer is not allowed — so a collective inside such a node runs at a
fraction of the nominal rate and each step carries a fixed cost far above a peer copy's few
microseconds. Those two figures — an effective per-direction
bandwidth of a device's port and a fixed time per transfer across the node — cannot be seen
on one GPU; they are fitted on whole measured multi-GPU iterations
(`cost/data/pcie_links.json`, with its source and cross-validated error).

`link_rate` is what the communication model (cost/comm.py) reads for every link: a PCIe port
of a calibrated type at its catalog rate gets the calibrated figures; a port whose cluster file
declares its own bandwidth, and every other link, keeps what the cluster says.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

from heterog.errors import ClusterError
from heterog.hardware.cluster import Cluster

SCHEMA_VERSION = 1
DATA_FILE = "pcie_links.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class PcieLinkCalibration:
    """A GPU type's PCIe port as collectives and transfers inside its node use it."""

    gpu_type: str
    bandwidth_bytes_per_s: float  # effective payload rate per direction of one device's port
    latency_s: float  # fixed time of one transfer from port to port inside the node
    source: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ClusterError(f"PCIe calibration of {self.gpu_type}: bandwidth_bytes_per_s must be > 0.")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ClusterError(f"PCIe calibration of {self.gpu_type}: latency_s must be ≥ 0 seconds.")


def parse(doc: dict[str, Any], where: str) -> dict[str, PcieLinkCalibration]:
    """The calibrations of a pcie_links document, by GPU type."""
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ClusterError(f"{where}: schema_version {doc.get('schema_version')!r}; expected {SCHEMA_VERSION}.")
    out: dict[str, PcieLinkCalibration] = {}
    for i, e in enumerate(doc.get("links", [])):
        try:
            cal = PcieLinkCalibration(
                gpu_type=str(e["gpu_type"]),
                bandwidth_bytes_per_s=float(e["bandwidth_gbytes_per_s"]) * 1e9,
                latency_s=float(e["latency_us"]) * 1e-6,
                source=str(e["source"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ClusterError(
                f"{where}: links[{i}] needs gpu_type, bandwidth_gbytes_per_s, latency_us and source ({err})."
            ) from None
        if cal.gpu_type in out:
            raise ClusterError(f"{where}: {cal.gpu_type} is calibrated twice; keep one entry.")
        out[cal.gpu_type] = cal
    return out


@functools.cache
def calibrations() -> dict[str, PcieLinkCalibration]:
    """The shipped calibrations (cost/data/pcie_links.json), read once."""
    text = resources.files("heterog.cost").joinpath("data", DATA_FILE).read_text()
    return parse(json.loads(text), f"heterog/cost/data/{DATA_FILE}")


def link_rate(cluster: Cluster, name: str) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of link `name` as collectives and transfers see it: a
    calibrated type's PCIe port at its catalog rate takes the calibrated figures (half the
    port-to-port latency on each of a path's two ports), everything else what the cluster
    declares."""
    link = cluster.links[name]
    if link.kind != "pcie":
        return link.bandwidth_bytes_per_s, link.latency_s
    device = name.rsplit(".", 1)[0]
    gpu = cluster.gpu(device)
    cal = calibrations().get(gpu.name)
    if cal is None or link.bandwidth_bytes_per_s != gpu.intra_node_bandwidth_bytes_per_s:
        return link.bandwidth_bytes_per_s, link.latency_s
    return cal.bandwidth_bytes_per_s, max(link.latency_s, cal.latency_s / 2)


__all__ = ["PcieLinkCalibration", "calibrations", "link_rate", "parse"]
