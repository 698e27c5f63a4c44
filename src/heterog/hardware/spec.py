"""Cluster specs: YAML (or a plain dict) → a validated Cluster, and back.

Schema (units in field names; every bandwidth may be given as *_gbps = 1e9 bit/s, as NICs are
sold, *_gbytes_per_s = 1e9 byte/s, or *_bytes_per_s; latencies as *_us or *_s; memory as
memory_gib or memory_bytes):

    name: mixed-16
    kind: real                       # or 'emulated': local CPU processes (heterog.execute)
    switch:                          # optional: an oversubscribed core that every
      core_bandwidth_gbps: 400       #   inter-node transfer crosses
      latency_us: 1
    nodes:
      - name: a100                   # with `count: k`, write '{i}' in the name: n{i} → n0, n1, …
        nic_bandwidth_gbps: 200
        nic_latency_us: 10           # default 10
        intra_latency_us: 3          # default 3
        host_speed: 0.7              # optional: the host's speed relative to the reference
                                     #   host (1.0, the default); `heterog profile` measures it
        devices:
          - {type: A100-80GB, count: 4}          # named a100/gpu0 … a100/gpu3
          - {type: cpu, name: w0, slowdown: 2}   # emulated: `slowdown` × slower compute
    gpu_types: {NAME: {...}}         # optional custom types (cluster_to_dict writes them all)
    catalog: my-catalog.yaml         # optional: catalog files (`heterog calibrate --out`), relative
                                     #   to this file, whose types the devices may name
    price_per_hour: {T4: 0.35}       # optional: US dollars per device-hour by type; a node's or a
                                     #   device entry's `price_per_hour` too (hardware/prices.py)

Errors name the file, line and field, and say how to fix them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from heterog.errors import ClusterError, did_you_mean
from heterog.hardware import catalog, prices
from heterog.hardware import yamlfields as yf
from heterog.hardware.cluster import Cluster, build_cluster
from heterog.hardware.gputype import PRECISIONS, GpuType, gpu_extras_from_dict, gpu_extras_to_dict

SPEC_VERSION = 1
DEFAULT_NIC_LATENCY_S = 10e-6  # RDMA/TCP one-way latency order; HeteroG used 12 µs per transfer
DEFAULT_INTRA_LATENCY_S = 3e-6  # NVLink/PCIe peer copy including the launch
KINDS = ("real", "emulated")

_TOP = {"name", "kind", "description", "switch", "nodes", "gpu_types", "meta", "version", "catalog", prices.FIELD}
_NODE = {
    "name",
    "count",
    "devices",
    "nic_bandwidth_gbps",
    "nic_bandwidth_gbytes_per_s",
    "nic_bandwidth_bytes_per_s",
    "nic_latency_us",
    "nic_latency_s",
    "intra_latency_us",
    "intra_latency_s",
    "host_speed",
    prices.FIELD,
}
_DEVICE = {
    "type",
    "count",
    "name",
    "slowdown",
    "memory_gib",
    "memory_bytes",
    "intra_bandwidth_gbps",
    "intra_bandwidth_gbytes_per_s",
    "intra_bandwidth_bytes_per_s",
    prices.FIELD,
}
_SWITCH = {
    "core_bandwidth_gbps",
    "core_bandwidth_gbytes_per_s",
    "core_bandwidth_bytes_per_s",
    "latency_us",
    "latency_s",
}


def _gpu_type_from_dict(ctx: yf.Ctx, where: str, d: Any, name: str) -> GpuType:
    try:
        return GpuType(
            name=name,
            vendor=d["vendor"],
            peak_flops_per_s={p: float(d["peak_flops_per_s"].get(p, 0.0)) for p in PRECISIONS},
            memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
            memory_bytes=int(d["memory_bytes"]),
            intra_node_link=d["intra_node_link"],
            intra_node_bandwidth_bytes_per_s=float(d["intra_node_bandwidth_bytes_per_s"]),
            sources=dict(d.get("sources", {})),
            **gpu_extras_from_dict(d),
        )
    except KeyError as e:
        raise ctx.fail(where, d, None, f"GPU type {name!r} lacks {e.args[0]!r}.") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ctx.fail(where, d, None, f"GPU type {name!r} is malformed ({e}).") from None


def _catalog_types(ctx: yf.Ctx, doc: dict, base_dir: Path | None) -> dict[str, GpuType]:
    """The types of the catalog files named by the spec's `catalog:` (a path or a list),
    each path relative to the spec's own file: by name and by every alias."""
    paths = doc["catalog"]
    paths = [paths] if isinstance(paths, str) else paths
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ctx.fail(
            "", doc, "catalog", "expected a catalog file (or a list of them) written by `heterog calibrate`."
        )
    out: dict[str, GpuType] = {}
    for raw in paths:
        path = Path(raw) if Path(raw).is_absolute() or base_dir is None else base_dir / raw
        try:
            entries = catalog.catalog_entries(path)
        except ClusterError as e:
            raise ctx.fail("", doc, "catalog", str(e)) from None
        for entry in entries:
            g = catalog.gpu_from_entry(entry, str(path))
            for alias in [g.name, *entry.get("aka", [])]:
                out[alias] = g
    return out


def _parse(doc: Any, source: str, base_dir: Path | None = None) -> Cluster:
    ctx = yf.Ctx(source)
    yf.check_keys(ctx, "", doc, _TOP)
    for req in ("name", "nodes"):
        if req not in doc:
            raise ctx.fail("", doc, None, f"missing required field {req!r}.")
    kind = doc.get("kind", "real")
    if kind not in KINDS:
        raise ctx.fail("", doc, "kind", f"must be one of {', '.join(KINDS)}, found {kind!r}.")
    switch_bw, switch_latency_s = _switch(ctx, doc)
    raw_nodes = doc["nodes"]
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ctx.fail("", doc, "nodes", "expected a non-empty list of nodes.")
    reader = _NodeReader(ctx, kind, _custom_types(ctx, doc, base_dir))
    reader.type_prices = prices.type_prices(ctx, doc, reader.canonical_type)
    for i, n in enumerate(raw_nodes):
        reader.read(f"nodes[{i}]", n)
    prices.check_types_used(ctx, doc, reader.type_prices, set(reader.gpu_types))
    meta = dict(doc.get("meta") or {})
    if "description" in doc:
        meta["description"] = str(doc["description"])
    return build_cluster(
        name=str(doc["name"]),
        gpu_types=reader.gpu_types,
        nodes=reader.nodes,
        kind=kind,
        switch_core_bandwidth_bytes_per_s=switch_bw,
        switch_latency_s=switch_latency_s,
        meta=meta,
    )


def _custom_types(ctx: yf.Ctx, doc: dict, base_dir: Path | None) -> dict[str, GpuType]:
    """The spec's own GPU types: those of its catalog files, then its `gpu_types`."""
    custom: dict[str, GpuType] = _catalog_types(ctx, doc, base_dir) if "catalog" in doc else {}
    if "gpu_types" in doc:
        if not isinstance(doc["gpu_types"], dict):
            raise ctx.fail("", doc, "gpu_types", "expected a mapping of type name → fields.")
        for tname, tdoc in doc["gpu_types"].items():
            custom[str(tname)] = _gpu_type_from_dict(ctx, f"gpu_types.{tname}", tdoc, str(tname))
    return custom


def _switch(ctx: yf.Ctx, doc: dict) -> tuple[float | None, float]:
    """(core bandwidth, latency) of an oversubscribed switch; (None, 0) for a non-blocking one."""
    sw = doc.get("switch")
    if sw is None:
        return None, 0.0
    yf.check_keys(ctx, "switch", sw, _SWITCH)
    switch_bw = yf.bandwidth(ctx, "switch", sw, "core_bandwidth", None)
    if switch_bw is None:
        raise ctx.fail(
            "switch",
            sw,
            None,
            "a switch needs core_bandwidth_gbps (the oversubscribed core); omit `switch` for a non-blocking switch.",
        )
    return switch_bw, yf.latency(ctx, "switch", sw, "latency", 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class _DeviceEntry:
    """One entry of a node's `devices`, read: what each of its `count` devices gets."""

    gpu: GpuType
    count: int
    slowdown: float
    memory_bytes: int | None
    intra_bandwidth_bytes_per_s: float | None
    price_per_hour: float | None


class _NodeReader:
    """Reads the `nodes` list entry by entry into build_cluster's node dicts, keeping node and
    device names unique across the whole spec."""

    def __init__(self, ctx: yf.Ctx, kind: str, custom: dict[str, GpuType]):
        self.ctx, self.kind, self.custom = ctx, kind, custom
        self.gpu_types: dict[str, GpuType] = {}
        self.type_prices: dict[str, float] = {}  # the top-level price_per_hour, by type
        self.nodes: list[dict[str, Any]] = []
        self.node_where: dict[str, str] = {}
        self.device_node: dict[str, str] = {}

    def read(self, where: str, n: Any) -> None:
        """A node entry: `count` copies of it, named by its `{i}` pattern."""
        ctx = self.ctx
        yf.check_keys(ctx, where, n, _NODE)
        for req in ("name", "devices"):
            if req not in n:
                raise ctx.fail(where, n, None, f"missing required field {req!r}.")
        count = n.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ctx.fail(where, n, "count", f"must be a positive integer, found {count!r}.")
        if count > 1 and "{i}" not in str(n["name"]):
            raise ctx.fail(
                where,
                n,
                "name",
                f"a node with count {count} needs '{{i}}' in its name (e.g. 'node{{i}}') so each copy is unique.",
            )
        nic_bw = yf.bandwidth(ctx, where, n, "nic_bandwidth", None)
        if nic_bw is None:
            raise ctx.fail(where, n, None, "missing nic_bandwidth_gbps (the node's network card).")
        links = {
            "nic_bandwidth_bytes_per_s": nic_bw,
            "nic_latency_s": yf.latency(ctx, where, n, "nic_latency", DEFAULT_NIC_LATENCY_S),
            "intra_latency_s": yf.latency(ctx, where, n, "intra_latency", DEFAULT_INTRA_LATENCY_S),
            "host_speed": (
                yf.plausible(ctx, where, n, "host_speed", yf.number(ctx, where, n, "host_speed"), yf.HOST_SPEED)
                if "host_speed" in n
                else 1.0
            ),
        }
        if not isinstance(n["devices"], list) or not n["devices"]:
            raise ctx.fail(where, n, "devices", "expected a non-empty list of devices.")
        entries = [self._entry(f"{where}.devices[{j}]", d) for j, d in enumerate(n["devices"])]
        node_share = self._node_share(where, n, entries)
        for copy in range(count):
            node_name = str(n["name"]).replace("{i}", str(copy))
            if node_name in self.node_where:
                raise ctx.fail(
                    where,
                    n,
                    "name",
                    f"duplicate node name {node_name!r} (also {self.node_where[node_name]}); "
                    f"node names must be unique.",
                )
            self.node_where[node_name] = where
            devices = self._devices(where, n, node_name, entries, node_share)
            self.nodes.append({"name": node_name, "devices": devices, **links})

    def _entry(self, dwhere: str, d: Any) -> _DeviceEntry:
        ctx = self.ctx
        yf.check_keys(ctx, dwhere, d, _DEVICE)
        if "type" not in d:
            raise ctx.fail(dwhere, d, None, "missing required field 'type' (a GPU type, see `heterog gpus`).")
        gt = self._gpu_type(dwhere, d)
        self.gpu_types[gt.name] = gt
        dcount = d.get("count", 1)
        if isinstance(dcount, bool) or not isinstance(dcount, int) or dcount < 1:
            raise ctx.fail(dwhere, d, "count", f"must be a positive integer, found {dcount!r}.")
        if "name" in d and dcount > 1:
            raise ctx.fail(dwhere, d, "name", "a named device entry must have count 1.")
        if self.kind == "emulated" and gt.vendor != "cpu":
            raise ctx.fail(
                dwhere,
                d,
                "type",
                f"an emulated cluster runs local CPU processes; use type 'cpu' (with a slowdown), not {gt.name!r}.",
            )
        if "memory_gib" in d and "memory_bytes" in d:
            raise ctx.fail(dwhere, d, "memory_bytes", "give memory once (memory_gib or memory_bytes).")
        mem = None
        if "memory_gib" in d:
            gib = yf.number(ctx, dwhere, d, "memory_gib")
            mem = int(yf.plausible(ctx, dwhere, d, "memory_gib", gib * 2**30, yf.MEMORY))
        elif "memory_bytes" in d:
            mem = int(
                yf.plausible(ctx, dwhere, d, "memory_bytes", yf.number(ctx, dwhere, d, "memory_bytes"), yf.MEMORY)
            )
        slowdown = (
            yf.plausible(ctx, dwhere, d, "slowdown", yf.number(ctx, dwhere, d, "slowdown"), yf.SLOWDOWN)
            if "slowdown" in d
            else 1.0
        )
        intra_bw = yf.bandwidth(ctx, dwhere, d, "intra_bandwidth", None)
        return _DeviceEntry(
            gpu=gt,
            count=dcount,
            slowdown=slowdown,
            memory_bytes=mem,
            intra_bandwidth_bytes_per_s=intra_bw,
            price_per_hour=prices.read_price(ctx, dwhere, d) if prices.FIELD in d else None,
        )

    def _node_share(self, where: str, n: Any, entries: list[_DeviceEntry]) -> float | None:
        """Each device's part of the node's `price_per_hour` (an instance's price, split evenly)."""
        if prices.FIELD not in n:
            return None
        if any(e.price_per_hour is not None for e in entries):
            raise self.ctx.fail(
                where, n, prices.FIELD, "priced twice: give the node's price or its devices' prices, not both."
            )
        count = sum(e.count for e in entries)
        return prices.read_price(self.ctx, where, n, devices=count) / count

    def canonical_type(self, name: str) -> str:
        """The type a spelling means here: one of the spec's own types, else the catalog's."""
        return name if name in self.custom else catalog.get_gpu(name).name

    def _gpu_type(self, where: str, m: dict) -> GpuType:
        tname = m["type"]
        if not isinstance(tname, str):
            raise self.ctx.fail(where, m, "type", f"expected a GPU type name, found {tname!r}.")
        if tname in self.custom:
            return self.custom[tname]
        try:
            return catalog.get_gpu(tname)
        except ClusterError as e:
            raise self.ctx.fail(where, m, "type", str(e)) from None

    def _devices(
        self, where: str, n: Any, node_name: str, entries: list[_DeviceEntry], node_share: float | None
    ) -> list[dict[str, Any]]:
        """The devices of one copy of a node: named, or numbered per prefix (gpu0, cpu1, …)."""
        devices: list[dict[str, Any]] = []
        k_by_prefix: dict[str, int] = {}
        for j, (e, d) in enumerate(zip(entries, n["devices"])):
            prefix = "cpu" if e.gpu.vendor == "cpu" else "gpu"
            for _ in range(e.count):
                if "name" in d:
                    dev_name = str(d["name"])
                else:
                    k = k_by_prefix.get(prefix, 0)
                    k_by_prefix[prefix] = k + 1
                    dev_name = f"{node_name}/{prefix}{k}"
                if dev_name in self.device_node:
                    other = self.device_node[dev_name]
                    msg = (
                        f"duplicate device name {dev_name!r} in node {node_name!r}"
                        if other == node_name
                        else f"device {dev_name!r} is in two nodes ({other!r} and {node_name!r}); "
                        f"a device belongs to exactly one node: rename one"
                    )
                    raise self.ctx.fail(f"{where}.devices[{j}]", d, "name" if "name" in d else None, msg + ".")
                self.device_node[dev_name] = node_name
                dev: dict[str, Any] = {"name": dev_name, "gpu_type": e.gpu.name, "slowdown": e.slowdown}
                if e.memory_bytes is not None:
                    dev["memory_bytes"] = e.memory_bytes
                if e.intra_bandwidth_bytes_per_s is not None:
                    dev["intra_bandwidth_bytes_per_s"] = e.intra_bandwidth_bytes_per_s
                price = next(
                    (p for p in (e.price_per_hour, node_share, self.type_prices.get(e.gpu.name)) if p is not None), None
                )
                if price is not None:
                    dev["price_per_hour"] = price
                devices.append(dev)
        return devices


def builtin_clusters() -> list[str]:
    folder = resources.files("heterog.hardware").joinpath("clusters")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _builtin_text(name: str) -> str | None:
    f = resources.files("heterog.hardware").joinpath("clusters", f"{name}.yaml")
    return f.read_text() if f.is_file() else None


def parse_cluster_yaml(text: str, source: str = "<yaml>", base_dir: Path | None = None) -> Cluster:
    try:
        doc = yaml.load(text, Loader=yf.LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise ClusterError(f"{source}:{line}: not valid YAML ({e.problem}).") from None
    except ClusterError as e:
        raise ClusterError(f"{source}: {e}") from None
    return _parse(doc, source, base_dir)


def load_cluster(name_or_path: str | os.PathLike) -> Cluster:
    """A built-in cluster by name ('paper-8gpu', 'mixed-16', …) or a YAML file."""
    text = (
        _builtin_text(str(name_or_path))
        if "/" not in str(name_or_path) and not str(name_or_path).endswith((".yaml", ".yml"))
        else None
    )
    if text is not None:
        return parse_cluster_yaml(text, f"<built-in {name_or_path}>")
    path = Path(name_or_path)
    if not path.is_file():
        raise ClusterError(
            f"no cluster {str(name_or_path)!r}: not a built-in "
            f"({', '.join(builtin_clusters())}) and no such file."
            f"{did_you_mean(str(name_or_path), builtin_clusters())}"
        )
    return parse_cluster_yaml(path.read_text(), str(path), path.resolve().parent)


def cluster_from_dict(doc: dict[str, Any]) -> Cluster:
    """The inverse of cluster_to_dict (also accepts the YAML schema as a dict)."""
    return _parse(doc, f"<cluster {doc.get('name', '?') if isinstance(doc, dict) else '?'}>")


def _gpu_type_to_dict(g: GpuType) -> dict[str, Any]:
    return {
        "vendor": g.vendor,
        "peak_flops_per_s": dict(g.peak_flops_per_s),
        "memory_bandwidth_bytes_per_s": g.memory_bandwidth_bytes_per_s,
        "memory_bytes": g.memory_bytes,
        "intra_node_link": g.intra_node_link,
        "intra_node_bandwidth_bytes_per_s": g.intra_node_bandwidth_bytes_per_s,
        "sources": dict(g.sources),
        **gpu_extras_to_dict(g),
    }


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """A self-contained plain dict (exact units, GPU types included) that cluster_from_dict
    turns back into an equal Cluster; Plan.cluster stores it."""
    nodes = []
    for n in cluster.nodes:
        devices = []
        for dn in n.devices:
            d = cluster.device(dn)
            gt = cluster.gpu_types[d.gpu_type]
            entry: dict[str, Any] = {"name": d.name, "type": d.gpu_type, "slowdown": d.slowdown}
            if d.memory_bytes is not None:
                entry["memory_bytes"] = d.memory_bytes
            port_bw = cluster.links[Cluster.port(d.name, "up")].bandwidth_bytes_per_s
            if port_bw != gt.intra_node_bandwidth_bytes_per_s:
                entry["intra_bandwidth_bytes_per_s"] = port_bw
            if d.price_per_hour is not None:
                entry[prices.FIELD] = d.price_per_hour
            devices.append(entry)
        node: dict[str, Any] = {
            "name": n.name,
            "nic_bandwidth_bytes_per_s": n.nic_bandwidth_bytes_per_s,
            "nic_latency_s": n.nic_latency_s,
            "intra_latency_s": n.intra_latency_s,
        }
        if n.host_speed != 1.0:  # omitted at the default, so older documents stay as they were
            node["host_speed"] = n.host_speed
        nodes.append({**node, "devices": devices})
    out: dict[str, Any] = {
        "version": SPEC_VERSION,
        "name": cluster.name,
        "kind": cluster.kind,
        "gpu_types": {k: _gpu_type_to_dict(g) for k, g in cluster.gpu_types.items()},
        "nodes": nodes,
    }
    if cluster.switch_core:
        core = cluster.links[cluster.switch_core]
        out["switch"] = {"core_bandwidth_bytes_per_s": core.bandwidth_bytes_per_s, "latency_s": core.latency_s}
    if cluster.meta:
        out["meta"] = dict(cluster.meta)
    return out


def with_gpu_type(cluster: Cluster, gpu: GpuType) -> Cluster:
    """`cluster` with the figures of its type `gpu.name` replaced by `gpu`'s (a calibration
    of that type: `heterog plan --profile`)."""
    if gpu.name not in cluster.gpu_types:
        raise ClusterError(
            f"cluster {cluster.name!r} has no device of type {gpu.name!r} (its types: {', '.join(cluster.gpu_types)})."
        )
    doc = cluster_to_dict(cluster)
    doc["gpu_types"][gpu.name] = _gpu_type_to_dict(gpu)
    return cluster_from_dict(doc)


def with_prices(cluster: Cluster, usd_per_hour: dict[str, float]) -> Cluster:
    """`cluster` with each named type's devices priced at usd_per_hour[type] (US dollars per
    device-hour), as a cluster file's top-level `price_per_hour` would (`heterog plan --price`);
    the other devices keep their prices."""
    named = {t if t in cluster.gpu_types else catalog.get_gpu(t).name for t in usd_per_hour}
    doc = cluster_to_dict(cluster)
    doc[prices.FIELD] = dict(usd_per_hour)
    for node in doc["nodes"]:
        for d in node["devices"]:
            if d["type"] in named:
                d.pop(prices.FIELD, None)
    return cluster_from_dict(doc)
