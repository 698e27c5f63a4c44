"""Shaped links between emulated nodes: one network namespace per node, joined to a bridge.

Layout (as root): a hub namespace holds a bridge `br0`; each emulated node i gets a
namespace with `eth0` (10.77.0.(i+1)/24), one end of a veth pair whose other end `hv<i>`
is a port of the bridge. tc TBF on `eth0` limits what the node sends (its NIC up link), TBF
on `hv<i>` what it receives (its NIC down link), both at the cluster's NIC bandwidth. Ranks
of one node share its namespace, so their traffic stays local and unshaped, like an
intra-node fabric. Gloo is told to use `eth0` (GLOO_SOCKET_IFNAME) and rank 0's address as
MASTER_ADDR. The host's own interfaces and loopback are never touched.

Everything created is removed on exit, also on failure (deleting a namespace removes its
veth ends and qdiscs). When not root, or when a step fails, the run falls back to no
shaping and says why. A launcher killed by SIGKILL cannot remove them: before creating its
namespaces it writes an owner file (its pid and start time) under the temp dir, and a later
run deletes namespaces whose owner is dead and in which no process runs
(remove_stale_namespaces).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from heterog.execute.stale import remove_stale_runs
from heterog.hardware.cluster import Cluster
from heterog.jsonio import write_atomic

PREFIX = "hg"
# Namespaces are global to the machine, so their owner files are too (not under $TMPDIR,
# which differs between runs); only root makes namespaces, and /run is root's.
OWNERS_DIR = Path("/run/heterog-netns-owners")
# A namespace this young without an owner record may be one a launcher is still setting up
# (its ranks not yet inside); never remove it. /run/netns/<name> is created with the namespace.
YOUNG_NAMESPACE_S = 10.0


class ShapingUnavailable(Exception):
    """Links cannot be shaped here; the caller runs unshaped and reports this reason."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise ShapingUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise ShapingUnavailable(f"`tc {' '.join(args)}` in {ns} failed: {r.stderr.strip()}")


def tbf_args(rate_bytes_per_s: float) -> list[str]:
    """TBF parameters: burst ≥ rate / HZ (one timer tick of tokens), at least 64 KiB."""
    rate_bits = max(8_000, int(rate_bytes_per_s * 8))
    burst = max(64 * 1024, int(rate_bytes_per_s / 100))
    return ["rate", f"{rate_bits}bit", "burst", str(burst), "latency", "200ms"]


@dataclass
class LinkShaping:
    """Namespaces of one run; use as a context manager (removes them on exit)."""

    cluster: Cluster
    devices: tuple[str, ...]  # rank → device
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    wrap: dict[int, list[str]] = field(default_factory=dict)
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    links: dict[str, float] = field(default_factory=dict)  # node → shaped bandwidth (bytes/s)

    def __enter__(self) -> LinkShaping:
        if os.geteuid() != 0:
            raise ShapingUnavailable("not root: network namespaces and tc need root")
        remove_stale_runs()  # a killed run's ranks and namespaces, before we add ours
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _owner_file(self):
        return OWNERS_DIR / f"{self.token}.json"

    def _create(self) -> None:
        write_atomic(
            self._owner_file(), json.dumps({"pid": os.getpid(), "create_time": psutil.Process().create_time()})
        )
        nodes: list[str] = []
        for d in self.devices:
            n = self.cluster.node_of[d]
            if n not in nodes:
                nodes.append(n)
        if len(nodes) > 250:
            raise ShapingUnavailable(f"{len(nodes)} nodes exceed one /24 subnet")
        hub = f"hg{self.token}hub"
        _ip("netns", "add", hub)
        self.namespaces.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        addr_of: dict[str, str] = {}
        for i, node in enumerate(nodes):
            ns = f"hg{self.token}n{i}"
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("-n", hub, "link", "add", f"hv{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"hv{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"hv{i}", "up")
            addr = f"10.77.0.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            bw = self.cluster.node_index[node].nic_bandwidth_bytes_per_s
            _tc(ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf_args(bw))
            _tc(hub, "qdisc", "add", "dev", f"hv{i}", "root", "tbf", *tbf_args(bw))
            addr_of[node] = addr
            self.links[node] = bw
        for rank, d in enumerate(self.devices):
            node = self.cluster.node_of[d]
            ns = f"hg{self.token}n{nodes.index(node)}"
            self.wrap[rank] = ["ip", "netns", "exec", ns]
            self.env[rank] = {"GLOO_SOCKET_IFNAME": "eth0"}
        self.master_addr = addr_of[self.cluster.node_of[self.devices[0]]]

    def remove(self) -> None:
        """Delete every namespace this run made (their veths and qdiscs go with them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.namespaces.clear()
        self._owner_file().unlink(missing_ok=True)


def leftover_namespaces() -> list[str]:
    """Namespaces named like ours (for tests that check nothing is left behind)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith("hg")]


def _owner_alive(token: str) -> bool:
    f = OWNERS_DIR / f"{token}.json"
    try:
        doc = json.loads(f.read_text())
        return abs(psutil.Process(int(doc["pid"])).create_time() - float(doc["create_time"])) < 1e-3
    except (OSError, ValueError, KeyError, psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _young(ns: str) -> bool:
    try:
        return time.time() - (Path("/run/netns") / ns).stat().st_mtime < YOUNG_NAMESPACE_S
    except OSError:
        return False


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of ours whose launcher is dead and in which nothing runs; return them."""
    if os.geteuid() != 0:
        return []
    try:
        names = leftover_namespaces()
    except (OSError, subprocess.SubprocessError):
        return []
    removed = []
    for ns in names:
        token = ns[len(PREFIX) : len(PREFIX) + 6]
        # a launcher records itself before it makes its namespaces: with its record there, its
        # death decides (a launcher killed seconds after starting left namespaces that young);
        # without one, only a namespace old enough is surely nobody's setup in progress
        recorded = (OWNERS_DIR / f"{token}.json").exists()
        if _owner_alive(token) or (not recorded and _young(ns)):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
        if pids.stdout.strip():
            continue
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        removed.append(ns)
    for f in OWNERS_DIR.glob("*.json") if OWNERS_DIR.is_dir() else []:
        if not _owner_alive(f.stem):
            f.unlink(missing_ok=True)
    return removed
