"""Measure what the links of an emulated cluster really carry: a tc-shaped NIC between two
nodes, and the loopback between two devices (ranks) of one node.

A cluster YAML gives a node's NIC bandwidth; netns.py shapes it with tc TBF. What gloo then
moves over it is less than the nominal rate, for physical reasons no per-link constant in the
YAML states: TBF counts whole frames (Ethernet + IP + TCP headers: ~66 of every 1514 bytes
are not payload), the reverse direction's ACKs take tokens from the same bucket as that
direction's data, gloo adds per-message work, and a ring all-reduce of two members sends and
receives at once (both directions of the node's NIC busy). The cost model's alpha–beta
transfer time (cost/comm.py) counts none of this, so plans that sync large gradients
across a shaped link were predicted too fast.

`measure_shaped_link(cluster, src, dst)` creates the run's own namespaces (netns.LinkShaping),
starts one gloo rank in each of the two devices' node namespaces, and times

- one-way messages of two sizes (→ latency and payload bandwidth: a line through two points),
- the executor's own two-member ring all-reduce (execute/collectives.py) of one size
  (→ the bandwidth both directions get when used at once),

and returns a `LinkMeasurement`. Its `efficiency` (measured payload bandwidth ÷ the slower
NIC's nominal rate) is what `cost.profile.LinkCalibration` carries to the cost model. Two
processes, a few seconds; needs root (namespaces), like the shaped runs themselves.

`measure_intra_link` times the same over this host's loopback: the `cpu` type declares
2 GB/s between two ranks of a node, and gloo moved 0.5–0.8 GB/s per member in a two-member
ring on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from heterog.cost.profile import LinkCalibration, LinkScope
from heterog.errors import ResourceError
from heterog.execute.netns import LinkShaping, ShapingUnavailable
from heterog.hardware.cluster import Cluster

# (one-way sizes, ring size): latency from the small message, rate from both. Through a
# shaped NIC of ~25 MB/s a few MiB take a fraction of a second; through loopback they take
# milliseconds, where gloo's per-message work would still hide the rate.
SHAPED_BYTES = ((256 * 1024, 4 * 2**20), 8 * 2**20)
LOOPBACK_BYTES = ((2**20, 16 * 2**20), 32 * 2**20)
REPEATS = 3
TIMEOUT_S = 120


class LinkMeasurementError(ResourceError):
    """The two-rank link measurement could not run or did not finish."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkMeasurement:
    """What gloo moved over one shaped link, next to what the cluster declares."""

    src: str
    dst: str
    nominal_bandwidth_bytes_per_s: float  # the slower NIC of the two nodes, as declared
    latency_s: float  # one-way message: fixed part
    one_way_bandwidth_bytes_per_s: float  # one-way message: payload bytes per second
    ring_bandwidth_bytes_per_s: float  # two-member ring all-reduce: bytes each member sends / s
    one_way_times_s: tuple[tuple[float, float], ...] = ()  # (bytes, median seconds)
    ring_time_s: float = 0.0

    @property
    def efficiency(self) -> float:
        """Payload bandwidth of a one-way transfer ÷ the nominal rate."""
        return self.one_way_bandwidth_bytes_per_s / self.nominal_bandwidth_bytes_per_s

    @property
    def duplex_efficiency(self) -> float:
        """Payload bandwidth per direction when both directions are busy (a ring step) ÷ the
        nominal rate."""
        return self.ring_bandwidth_bytes_per_s / self.nominal_bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "nominal_bandwidth_bytes_per_s": self.nominal_bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
            "one_way_bandwidth_bytes_per_s": self.one_way_bandwidth_bytes_per_s,
            "ring_bandwidth_bytes_per_s": self.ring_bandwidth_bytes_per_s,
            "efficiency": self.efficiency,
            "duplex_efficiency": self.duplex_efficiency,
            "one_way_times_s": [list(x) for x in self.one_way_times_s],
            "ring_time_s": self.ring_time_s,
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, master_addr: str, port: int, out_path: str, sizes: str) -> None:
    """One of the two ranks: one-way messages rank 0 → rank 1, then ring all-reduces."""
    # torch only in the rank processes: measuring a link needs none in the caller
    import torch
    import torch.distributed as dist

    from heterog.execute.collectives import ProcessGroupCache, allreduce_sum

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    rows: dict[str, Any] = {"one_way": [], "ring": []}
    *one_way_bytes, ring_bytes = (int(x) for x in sizes.split(","))
    for nbytes in one_way_bytes:
        t = torch.ones(nbytes // 4)
        times = []
        for _ in range(REPEATS + 1):  # the first is a warm-up (connection, buffers)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
            dist.barrier()  # the receiver has it when the barrier passes
            times.append(time.perf_counter() - t0)
        rows["one_way"].append([nbytes, statistics.median(times[1:])])
    groups = ProcessGroupCache(timeout_s=60)
    groups.create_all([[0, 1]])
    flat = torch.ones(ring_bytes // 4)
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        allreduce_sum(flat, [0, 1], "ring", None, groups)
        times.append(time.perf_counter() - t0)
    rows["ring"].append([ring_bytes, statistics.median(times[1:])])
    # a barrier's own round trip, to take out of the one-way times
    bt = []
    for _ in range(5):
        t0 = time.perf_counter()
        dist.barrier()
        bt.append(time.perf_counter() - t0)
    rows["barrier_s"] = statistics.median(bt)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _fit(rows: dict[str, Any], src: str, dst: str, nominal: float) -> LinkMeasurement:
    (b0, t0), (b1, t1) = rows["one_way"]
    barrier = rows.get("barrier_s", 0.0)
    t0, t1 = max(t0 - barrier, 1e-9), max(t1 - barrier, 1e-9)
    bw = (b1 - b0) / max(t1 - t0, 1e-9)
    latency = max(t0 - b0 / bw, 0.0)
    ring_bytes, ring_s = rows["ring"][0]
    # a two-member ring sends half the buffer twice (reduce-scatter, all-gather): the buffer's
    # size per member, both directions at once; its own message latencies taken out
    ring_bw = ring_bytes / max(ring_s - 2 * latency, 1e-9)
    return LinkMeasurement(
        src=src,
        dst=dst,
        nominal_bandwidth_bytes_per_s=nominal,
        latency_s=latency,
        one_way_bandwidth_bytes_per_s=bw,
        ring_bandwidth_bytes_per_s=ring_bw,
        one_way_times_s=tuple((float(b), float(t)) for b, t in rows["one_way"]),
        ring_time_s=float(ring_s),
    )


def _run_pair(
    wrap: Mapping[int, list[str]],
    env: Mapping[int, dict[str, str]],
    master_addr: str,
    sizes: tuple[tuple[int, int], int],
    what: str,
) -> dict[str, Any]:
    """Run the two ranks of a measurement (each under its own command prefix and environment)
    with the message sizes `sizes` and return rank 0's rows."""
    (small, large), ring = sizes
    with tempfile.TemporaryDirectory(prefix="heterog-link-") as tmp:
        out, port = Path(tmp) / "rows.json", _free_port()
        procs = [
            subprocess.Popen(
                [
                    *wrap[r],
                    sys.executable,
                    "-m",
                    "heterog.profile.links",
                    str(r),
                    master_addr,
                    str(port),
                    str(out),
                    f"{small},{large},{ring}",
                ],
                env={**os.environ, **env[r]},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        errors: list[str] = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                errors.append(f"a rank did not finish within {TIMEOUT_S} s")
            if p.returncode:
                errors.extend((err or "").strip().splitlines()[-1:] or [f"exit {p.returncode}"])
        if errors or not out.exists():
            raise LinkMeasurementError(
                f"measuring {what} failed: {errors}; run without link calibration (the declared link rates are used)."
            )
        return json.loads(out.read_text())


def measure_shaped_link(cluster, src: str, dst: str) -> LinkMeasurement:
    """Two gloo ranks on the nodes of `src` and `dst`, their NICs shaped as the cluster says
    (netns.LinkShaping): one-way messages and a two-member ring all-reduce (see the module
    docstring). Raises LinkMeasurementError when the links cannot be shaped or a rank fails."""
    if cluster.node_of[src] == cluster.node_of[dst]:
        raise LinkMeasurementError(
            f"{src} and {dst} share node {cluster.node_of[src]}: there is no "
            f"shaped link between them to measure; pick devices on two nodes."
        )
    nominal = min(cluster.node_index[cluster.node_of[d]].nic_bandwidth_bytes_per_s for d in (src, dst))
    try:
        links = LinkShaping(cluster=cluster, devices=(src, dst)).__enter__()
    except ShapingUnavailable as e:
        raise LinkMeasurementError(f"cannot shape the link {src} ↔ {dst} here: {e}") from None
    try:
        rows = _run_pair(links.wrap, links.env, links.master_addr, SHAPED_BYTES, f"the shaped link {src} ↔ {dst}")
    finally:
        links.remove()
    return _fit(rows, src, dst, nominal)


def measure_intra_link(cluster, src: str, dst: str) -> LinkMeasurement:
    """Two gloo ranks on this host's loopback, as two devices of one emulated node talk (both
    ranks of a node share its namespace, so their bytes never cross a shaped NIC): what the
    kernel and gloo copy per second is the node's intra-node rate, which the `cpu` type only
    declares. No root needed."""
    if cluster.node_of[src] != cluster.node_of[dst] or src == dst:
        raise LinkMeasurementError(
            f"{src} and {dst} are not two devices of one node; pick two "
            f"devices of the node whose intra-node link to measure."
        )
    nominal = min(cluster.links[Cluster.port(d, "up")].bandwidth_bytes_per_s for d in (src, dst))
    rows = _run_pair({0: [], 1: []}, {0: {}, 1: {}}, "127.0.0.1", LOOPBACK_BYTES, f"the intra-node link {src} ↔ {dst}")
    return _fit(rows, src, dst, nominal)


def _calibration(node: str, m: LinkMeasurement, scope):
    return LinkCalibration(
        node=node,
        one_way_efficiency=min(m.efficiency, 1.0),
        duplex_efficiency=min(m.duplex_efficiency, 1.0),
        latency_s=m.latency_s,
        scope=scope,
    )


def calibrate_links(cluster, *, nics: bool = True, say=lambda msg: None) -> tuple[tuple[Any, LinkMeasurement], ...]:
    """(`cost.profile.LinkCalibration`, the measurement) for the links of an emulated cluster:
    the intra-node link of every node with two devices or more (two of its devices), and with
    `nics` (needs root) the NIC of every node but the one with the fastest NIC, each measured
    against a device of that node (so the measured node's NIC is the slower end of the pair,
    the one the measurement describes). Efficiencies are capped at 1: TBF's burst lets a
    few-MiB message pass a little above the rate, a long stream not."""
    nodes = [n for n in cluster.nodes if n.devices]
    out = []
    for n in nodes:
        if len(n.devices) >= 2:
            say(f"measuring the intra-node link of {n.name}")
            m = measure_intra_link(cluster, n.devices[0], n.devices[1])
            out.append((_calibration(n.name, m, LinkScope.INTRA), m))
    if not nics or len(nodes) < 2:
        return tuple(out)
    ref = max(nodes, key=lambda n: n.nic_bandwidth_bytes_per_s)
    for n in nodes:
        if n is ref:
            continue
        say(f"measuring the shaped link {ref.name} ↔ {n.name}")
        m = measure_shaped_link(cluster, ref.devices[0], n.devices[0])
        out.append((_calibration(n.name, m, LinkScope.NIC), m))
    return tuple(out)


if __name__ == "__main__":  # one rank of a measurement (in its node's namespace when shaped)
    _rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
