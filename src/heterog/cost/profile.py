"""Measured per-node times that override the analytic estimate.

File format (a versioned heterog artifact, JSON):

    {"kind": "heterog.Profile", "version": 1,
     "model": "resnet50", "graph_fingerprint": "…",        # optional: checked when present
     "precision": "fp32",
     "times": {"layer1.0.conv1": {"A100-80GB": {"fwd": [[8, 0.00012], [32, 0.00041]],
                                                  "bwd": [[8, 0.00025], [32, 0.00080]]}}}}

Each list holds [batch, time_s] measurements. Between them the time is interpolated
linearly; beyond the largest batch it follows the line through the last two points (HeteroG
fitted time linearly in the batch), below the smallest it scales down proportionally;
batch 0 takes 0 s.
"""

from __future__ import annotations

import math
import warnings
from bisect import bisect_left
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from heterog.cost import comm
from heterog.errors import ArtifactError
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_from_dict, cluster_to_dict
from heterog.ir.kinds import Phase, SyncMethod
from heterog.jsonio import Artifact

KIND = "heterog.Profile"
SCHEMA_VERSION = 1
PHASES = ("fwd", "bwd")  # the file's keys for the two phases
PHASE_KEY = {Phase.FORWARD: "fwd", Phase.BACKWARD: "bwd"}


class ProfileError(ArtifactError):
    """A malformed measured-profile file, or one made for another graph."""


@dataclass(frozen=True, kw_only=True)
class Profile(Artifact, kind=KIND, version=SCHEMA_VERSION):
    model: str = ""
    precision: str = "fp32"
    graph_fingerprint: str = ""
    # node → device type → phase → ((batch, time_s), …) sorted by batch
    times: dict[str, dict[str, dict[str, tuple[tuple[float, float], ...]]]] = field(default_factory=dict)

    def time_s(self, node: str, gpu_type: str, phase: Phase, batch: float) -> float | None:
        pts = self.times.get(node, {}).get(gpu_type, {}).get(PHASE_KEY[phase])
        if not pts:
            return None
        if batch <= 0:
            return 0.0
        batches = [b for b, _ in pts]
        if len(pts) == 1:
            b0, t0 = pts[0]
            return t0 * batch / b0
        if batch <= batches[0]:
            return pts[0][1] * batch / batches[0]
        j = bisect_left(batches, batch)
        (b0, t0), (b1, t1) = (pts[-2], pts[-1]) if j >= len(pts) else (pts[j - 1], pts[j])
        return max(t0 + (t1 - t0) * (batch - b0) / (b1 - b0), 0.0)

    def check_against(self, graph) -> None:
        if self.graph_fingerprint and self.graph_fingerprint != graph.fingerprint():
            raise ProfileError(
                f"the profile was measured for another graph (fingerprint "
                f"{self.graph_fingerprint}, this one {graph.fingerprint()}); "
                f"profile this model again."
            )
        unknown = [n for n in self.times if n not in graph.index]
        if unknown:
            raise ProfileError(
                f"the profile names {len(unknown)} node(s) not in the graph of "
                f"{graph.model}, e.g. {unknown[:3]}; was it measured for another model?"
            )

    # -- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "precision": self.precision,
            "graph_fingerprint": self.graph_fingerprint,
            "times": {
                n: {g: {p: [list(x) for x in pts] for p, pts in ph.items()} for g, ph in by.items()}
                for n, by in self.times.items()
            },
        }

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "<profile>") -> Profile:
        raw = doc.get("times")
        if not isinstance(raw, dict):
            raise ProfileError(f"{source}: 'times' must map node → device type → phase → [[batch, time_s], …].")
        times: dict[str, dict[str, dict[str, tuple[tuple[float, float], ...]]]] = {}
        for node, by_type in raw.items():
            if not isinstance(by_type, dict):
                raise ProfileError(f"{source}: times[{node!r}] must map device type → phases.")
            times[node] = {}
            for gtype, phases in by_type.items():
                if not isinstance(phases, dict):
                    raise ProfileError(f"{source}: times[{node!r}][{gtype!r}] must map 'fwd'/'bwd' → points.")
                times[node][gtype] = {}
                for phase, pts in phases.items():
                    where = f"{source}: times[{node!r}][{gtype!r}][{phase!r}]"
                    if phase not in PHASES:
                        raise ProfileError(f"{where}: unknown phase; use 'fwd' or 'bwd'.")
                    if not isinstance(pts, list) or not pts:
                        raise ProfileError(f"{where}: expected a non-empty list of [batch, time_s].")
                    clean = []
                    for k, p in enumerate(pts):
                        ok = (
                            isinstance(p, (list, tuple))
                            and len(p) == 2
                            and all(
                                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in p
                            )
                        )
                        if not ok or p[0] <= 0 or p[1] < 0:
                            raise ProfileError(f"{where}[{k}]: expected [batch > 0, time_s ≥ 0], found {p!r}.")
                        clean.append((float(p[0]), float(p[1])))
                    clean.sort()
                    if len({b for b, _ in clean}) != len(clean):
                        raise ProfileError(
                            f"{where}: a batch size appears twice; keep one measurement "
                            f"per batch (e.g. the minimum of repeated runs)."
                        )
                    times[node][gtype][phase] = tuple(clean)
        return Profile(
            model=str(doc.get("model", "")),
            precision=str(doc.get("precision", "fp32")),
            graph_fingerprint=str(doc.get("graph_fingerprint", "") or ""),
            times=times,
        )


# -- links as measured -----------------------------------------------------------------------------


class LinkScope(StrEnum):
    """Which link of a node a calibration measured: its NIC (to other nodes) or the ports
    between its own devices (intra-node)."""

    NIC = "nic"
    INTRA = "intra"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkCalibration:
    """What one node's NIC — or, with scope INTRA, the link between two of its devices —
    carried when measured (profile/links.py), relative to what the cluster declares: payload
    bandwidth one way and with both directions busy, and the fixed time of one message. A
    tc-shaped NIC carries less than its nominal rate (frame headers and the other direction's
    ACKs take tokens), and less again when a ring step sends and receives at once; two gloo
    ranks on one host move bytes through the kernel's loopback at what their CPUs can copy."""

    node: str
    one_way_efficiency: float  # measured one-way payload bandwidth ÷ nominal
    duplex_efficiency: float  # measured per-direction bandwidth in a 2-member ring ÷ nominal
    latency_s: float  # one message's fixed time across the link (gloo included)
    scope: LinkScope = LinkScope.NIC

    def __post_init__(self) -> None:
        for name in ("one_way_efficiency", "duplex_efficiency"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 < v <= 2.0):
                raise ProfileError(
                    f"link calibration of node {self.node!r}: {name} {v!r} is not a "
                    f"plausible fraction of the nominal rate (0 < x ≤ 2); measure the link again."
                )
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ProfileError(f"link calibration of node {self.node!r}: latency_s must be ≥ 0 seconds.")


def _effective_cluster(cluster, calibrations: tuple[LinkCalibration, ...], duplex: bool):
    """The cluster with each calibrated node's NIC, and each calibrated node's device ports,
    at their measured bandwidth and latency."""
    doc = cluster_to_dict(cluster)
    for c in calibrations:
        node = next(n for n in doc["nodes"] if n["name"] == c.node)
        eff = c.duplex_efficiency if duplex else c.one_way_efficiency
        if c.scope == LinkScope.NIC:
            node["nic_bandwidth_bytes_per_s"] *= eff
            node["nic_latency_s"] = max(node["nic_latency_s"], c.latency_s)
            continue
        for d in node["devices"]:
            d["intra_bandwidth_bytes_per_s"] = eff * cluster.links[Cluster.port(d["name"], "up")].bandwidth_bytes_per_s
        node["intra_latency_s"] = max(node["intra_latency_s"], c.latency_s)
    with warnings.catch_warnings():  # a slow link made slower is still the cluster meant
        warnings.simplefilter("ignore")
        return cluster_from_dict(doc)


class LinkCalibratedCosts:
    """A cost model whose communication times use the links as measured: point-to-point
    transfers, the parameter server's one-way phases and collectives of three or more
    members at the one-way bandwidth; a collective of two members at the duplex bandwidth.
    Two members exchange both ways over one gloo connection (one socket, one I/O loop), which
    is what the duplex figure measured (profile/links.py: 0.56–0.81 of nominal, load-
    dependent); in a ring of three or more each member sends to one peer and receives from
    another over two connections, and the CNN's three-member even-DP ring ran in 1.62 s where
    the duplex rate predicted 2.21 s (docs/scenarios.md). Everything else is the wrapped model's
    (CostModel protocol, cost/model.py)."""

    def __init__(self, base, cluster, calibrations: tuple[LinkCalibration, ...]):
        unknown = [c.node for c in calibrations if c.node not in cluster.node_index]
        if unknown:
            raise ProfileError(
                f"link calibration names node(s) {unknown} that cluster {cluster.name!r} "
                f"does not have; calibrate this cluster's links."
            )
        self.base = base
        self.calibrations = tuple(calibrations)
        self._one_way = _effective_cluster(cluster, self.calibrations, duplex=False)
        self._duplex = _effective_cluster(cluster, self.calibrations, duplex=True)
        self._cache: dict[tuple, tuple[float, float]] = {}

    def __getattr__(self, name: str):  # the rest of the protocol (and its extensions)
        if name == "base":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        return comm.p2p_time_s(self._one_way, nbytes, src, dst)

    def collective_time_s(self, op: str, nbytes: float, devices, method: str = SyncMethod.RING) -> float:
        links = self._duplex if len(set(devices)) == 2 else self._one_way
        return comm.cached_collective_time_s(self._cache, links, op, nbytes, devices, method)

    def shard_collective_time_s(self, op: str, nbytes: float, devices, fractions) -> float:
        links = self._duplex if len(set(devices)) == 2 else self._one_way
        return comm.cached_shard_collective_time_s(self._cache, links, op, nbytes, devices, fractions)

    def ps_sync_time_s(self, nbytes: float, devices, server: str) -> float:
        return comm.cached_ps_sync_time_s(self._cache, self._one_way, nbytes, devices, server)
