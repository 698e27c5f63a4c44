"""The GPU catalog (catalog.yaml: data sheets with their sources) and the `cpu` device type,
whose rates are measured on this machine by a short probe and cached.

`get_gpu(name)` is the one way to turn a type name into a GpuType. Matching ignores case and
separators, reads '80g' as '80GB' and knows each type's other spellings (`aka`); a name that
several types share (a family: 'A100', 'V100', 'H100') is refused with the types it could
mean, and an unknown one gets the close names — never a silent guess. A catalog type without
measurements gets its efficiency from its public figures (hardware/public_model.py).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from heterog.errors import ClusterError
from heterog.hardware.cpu_probe import CPU_TYPE, cpu_gpu_type, measure_cpu
from heterog.hardware.gputype import PRECISIONS, Efficiency, GpuType, HostCosts, Price, PublicFigures
from heterog.hardware.public_model import derive
from heterog.ir.kinds import CATALOG_PRECISION

# glibc malloc's largest dynamic mmap threshold on 64-bit (mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX):
# larger allocations always get freshly mapped pages.
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20


def _tokens(name: str) -> tuple[str, ...]:
    """A name's words, lower case, memory sizes as '<n>g' ('80GB', '80gb', '80G' alike)."""
    return tuple(re.sub(r"^(\d+)gb$", r"\1g", t) for t in re.split(r"[^a-z0-9]+", name.lower()) if t)


def _norm(name: str) -> str:
    return "".join(_tokens(name))


CATALOG_ENV = "HETEROG_CATALOG"
HOST_FIELDS = (
    "forward_node_s",
    "forward_op_s",
    "backward_op_s",
    "autocast_cast_s",
    "optimizer_tensor_s",
    "kernel_gap_s",
    "cudnn_op_s",
)


@lru_cache(maxsize=1)
def _catalog_doc() -> dict[str, Any]:
    text = resources.files("heterog.hardware").joinpath("catalog.yaml").read_text()
    return yaml.safe_load(text)


def catalog_document() -> dict[str, Any]:
    """The packaged catalog.yaml as data (read once)."""
    return _catalog_doc()


def _host_from_entry(e: dict[str, Any], where: str) -> HostCosts:
    unknown = sorted(set(e) - set(HOST_FIELDS) - {"source"})
    if unknown:
        raise ClusterError(f"{where}: unknown host field(s) {unknown}; use {', '.join(HOST_FIELDS)}.")
    try:
        return HostCosts(**{k: float(e[k]) for k in HOST_FIELDS if k in e}, source=str(e.get("source", "")))
    except (TypeError, ValueError) as err:
        raise ClusterError(f"{where}: {err}") from None


def _efficiency_from_entry(e: dict[str, Any] | None, where: str) -> Efficiency:
    if not e:
        return Efficiency()
    try:
        return Efficiency(
            compute={str(k): float(v) for k, v in (e.get("compute") or {}).items()},
            conv={str(k): float(v) for k, v in (e.get("conv") or {}).items()},
            memory=None if e.get("memory") is None else float(e["memory"]),
            memory_by_kind={str(k): float(v) for k, v in (e.get("memory_by_kind") or {}).items()},
            size_scale=float(e.get("size_scale", 1.0)),
            inherits=str(e.get("inherits", "")),
            source=str(e.get("source", "")),
        )
    except (TypeError, ValueError, AttributeError) as err:
        raise ClusterError(f"{where}: efficiency is malformed ({err}).") from None


def _public_from_entry(e: dict[str, Any] | None, sources: dict[str, Any], where: str) -> PublicFigures | None:
    if not e:
        return None
    try:
        return PublicFigures.from_dict({**e, "source": e.get("source") or sources.get("public", "")})
    except KeyError as err:
        raise ClusterError(
            f"{where}: public figures lack {err.args[0]!r} (compute_units, boost_clock_mhz, "
            f"base_clock_mhz, board_power_w, tensor_cores, memory_type)."
        ) from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ClusterError(f"{where}: public figures are malformed ({err}).") from None


def _price_from_entry(e: Any, where: str) -> Price | None:
    if e is None:
        return None
    try:
        return Price.from_dict(e)
    except KeyError as err:
        raise ClusterError(f"{where}: price lacks {err.args[0]!r} (usd_per_hour, source, date).") from None
    except (TypeError, ValueError) as err:
        raise ClusterError(f"{where}: price is malformed ({err}).") from None


def gpu_from_entry(e: dict[str, Any], where: str = "catalog.yaml") -> GpuType:
    """A catalog entry as a GpuType; without an `efficiency` of its own (no measurements),
    its efficiency derived from its public figures (hardware/public_model.py)."""
    where = f"{where}: GPU type {e.get('name', '?')!r}"
    gpu = _gpu_type_of(e, where)
    if e.get("efficiency") or gpu.public is None:
        return gpu
    try:
        return derive(gpu)
    except ValueError as err:
        raise ClusterError(f"{where}: {err}") from None


def _gpu_type_of(e: dict[str, Any], where: str) -> GpuType:
    try:
        return GpuType(
            name=e["name"],
            vendor=e["vendor"],
            peak_flops_per_s={p: float(e["peak_tflops"].get(p, 0) or 0) * 1e12 for p in PRECISIONS},
            memory_bandwidth_bytes_per_s=float(e["memory_bandwidth_gbytes_per_s"]) * 1e9,
            memory_bytes=int(float(e["memory_gib"]) * 2**30),
            intra_node_link=e["intra_node_link"],
            intra_node_bandwidth_bytes_per_s=float(e["intra_node_bandwidth_gbytes_per_s"]) * 1e9,
            sources=dict(e.get("sources", {})),
            efficiency=_efficiency_from_entry(e.get("efficiency"), where),
            host=_host_from_entry(e["host"], where) if e.get("host") else None,
            public=_public_from_entry(e.get("public"), dict(e.get("sources") or {}), where),
            price=_price_from_entry(e.get("price"), where),
        )
    except KeyError as err:
        raise ClusterError(f"{where} lacks {err.args[0]!r} (see hardware/catalog.yaml for the fields).") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise ClusterError(f"{where} is malformed ({err}).") from None


def user_catalog_paths() -> list[Path]:
    """The user catalog files named by $HETEROG_CATALOG (several joined by os.pathsep)."""
    raw = os.environ.get(CATALOG_ENV, "")
    return [Path(p) for p in raw.split(os.pathsep) if p.strip()]


def catalog_entries(path: Path, named_by: str = "the cluster file") -> list[dict[str, Any]]:
    """The `gpus:` entries of a user catalog file (`heterog calibrate` writes one)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ClusterError(
            f"{named_by} names the catalog {path}, which cannot be read ({err.strerror}); fix the path."
        ) from None
    except yaml.YAMLError as err:
        raise ClusterError(f"{path}: not valid YAML ({err}).") from None
    gpus = doc.get("gpus") if isinstance(doc, dict) else None
    if not isinstance(gpus, list) or not all(isinstance(e, dict) for e in gpus):
        raise ClusterError(
            f"{path}: a user catalog needs a `gpus:` list of entries in the format of "
            f"hardware/catalog.yaml (`heterog calibrate` writes one)."
        )
    return gpus


@dataclass(frozen=True, slots=True)
class _Table:
    """The known types: by canonical name, and every spelling (name or alias) of each as its
    words (`_tokens`) → canonical name."""

    types: dict[str, GpuType]
    spellings: dict[tuple[str, ...], str]
    lookup: dict[str, str]  # the words joined → canonical name


def _gpu_table() -> _Table:
    return _gpu_table_for(os.environ.get(CATALOG_ENV, ""))


@lru_cache(maxsize=4)
def _gpu_table_for(user_catalogs: str) -> _Table:
    """The packaged catalog, then each user catalog in order (an entry with a known name
    replaces it)."""
    types: dict[str, GpuType] = {}
    spellings: dict[tuple[str, ...], str] = {}
    sources = [("catalog.yaml", e) for e in _catalog_doc()["gpus"]]
    for path in user_catalog_paths():
        sources += [(str(path), e) for e in catalog_entries(path, f"${CATALOG_ENV}")]
    for where, e in sources:
        g = gpu_from_entry(e, where)
        types[g.name] = g
        for alias in [g.name, *e.get("aka", [])]:
            spellings[_tokens(alias)] = g.name
    return _Table(
        types=types, spellings=spellings, lookup={"".join(words): canon for words, canon in spellings.items()}
    )


def _resolve(name: str) -> str:
    """The canonical type `name` means: an exact spelling (any case or separators, '80g' for
    '80GB') of a name or alias; else the same words in another order; else the one type whose
    name starts with these words. Several such types: ClusterError with the choices."""
    table = _gpu_table()
    words = _tokens(name)
    exact = table.lookup.get("".join(words))
    if exact is not None:
        return exact
    same = {canon for toks, canon in table.spellings.items() if sorted(toks) == sorted(words)}
    if len(same) == 1:
        return same.pop()
    family = sorted(
        {
            canon
            for toks, canon in table.spellings.items()
            if words and len(toks) > len(words) and toks[: len(words)] == words
        }
    )
    if len(family) == 1:
        return family[0]
    if family:
        raise ClusterError(
            f"GPU type {name!r} is ambiguous: it could be {', '.join(family)} (they differ in "
            f"memory, bandwidth or power); name one of them."
        )
    raise ClusterError(unknown_gpu_message(name))


def list_gpus(*, include_cpu: bool = False) -> list[GpuType]:
    """Every catalog GPU type, in catalog order; with include_cpu, the measured `cpu` type too."""
    out = list(_gpu_table().types.values())
    if include_cpu:
        out.append(cpu_gpu_type())
    return out


def gpu_names() -> list[str]:
    return [*_gpu_table().types, CPU_TYPE]


def get_gpu(name: str) -> GpuType:
    """The GpuType called `name` (case and separators ignored, aliases allowed; a family name
    several types share is refused with the choices); 'cpu' is measured here."""
    if _norm(name) == CPU_TYPE:
        return cpu_gpu_type()
    return _gpu_table().types[_resolve(name)]


def unknown_gpu_message(name: str) -> str:
    lookup = _gpu_table().lookup
    close = difflib.get_close_matches(_norm(name), list(lookup), n=3, cutoff=0.5)
    names = sorted({lookup[c] for c in close})
    hint = f" Did you mean {', '.join(names)}?" if names else ""
    return (
        f"unknown GPU type {name!r}.{hint} Known types: {', '.join(gpu_names())} "
        f"(`heterog gpus` lists them with their rates)."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class HostOverheads:
    """Per-kernel host costs of eager PyTorch on one device type (seconds)."""

    dispatch_s: float  # Python + dispatcher per op; GPU: overlapped with device work
    kernel_gap_s: float  # device-side minimum per kernel
    optimizer_per_tensor_s: float  # optimizer loop cost per parameter tensor
    synchronous: bool = False  # CPU: host cost adds to compute instead of overlapping
    backward_dispatch_s: float | None = None  # autograd engine per backward op (CPU measured)
    fresh_page_s_per_byte: float = 0.0  # CPU: cost of tensors too large for the heap (page faults)
    fresh_threshold_bytes: float = float("inf")


def host_overheads(gpu: GpuType) -> HostOverheads:
    """The CPU device type's own costs (measured); GPUs: see host_costs."""
    if gpu.vendor == "cpu":
        p = measure_cpu(gpu.cpu_threads)
        # a calibrated CPU type (heterog calibrate) carries the profiled machine's op costs
        dispatch_s = gpu.host.forward_op_s if gpu.host is not None else p.dispatch_s
        return HostOverheads(
            dispatch_s=dispatch_s,
            kernel_gap_s=0.0,
            optimizer_per_tensor_s=dispatch_s,
            synchronous=True,
            backward_dispatch_s=gpu.host.backward_op_s if gpu.host is not None else p.backward_dispatch_s,
            fresh_page_s_per_byte=p.fresh_page_s_per_byte,
            fresh_threshold_bytes=GLIBC_MMAP_THRESHOLD_MAX_BYTES,
        )
    h = host_costs(gpu)
    return HostOverheads(
        dispatch_s=h.forward_node_s,
        kernel_gap_s=h.kernel_gap_s,
        optimizer_per_tensor_s=h.optimizer_tensor_s,
        backward_dispatch_s=h.backward_op_s,
    )


def memory_by_kind_default() -> dict[str, float]:
    """Sustained bandwidth of each memory-bound kind relative to a copy, for types that do
    not give their own (catalog.yaml `memory_by_kind_default`, fitted on the H200 steps)."""
    return dict(_catalog_doc().get("memory_by_kind_default") or {})


def host_costs(gpu: GpuType) -> HostCosts:
    """The host costs that drive a GPU of type `gpu`: its own calibration when it has one,
    else the vendor's default (catalog.yaml `host_costs`, fitted on the H200 steps)."""
    if gpu.host is not None:
        return gpu.host
    table = _catalog_doc()["host_costs"]
    e = table.get(gpu.vendor, table["nvidia"])
    return _host_from_entry(e, f"catalog.yaml host_costs.{gpu.vendor}")


def gpu_from_device_name(device_name: str, memory_bytes: int | None = None) -> GpuType:
    """The catalog type of a physical device, from torch.cuda.get_device_name() (e.g. 'NVIDIA
    A100-SXM4-80GB', 'Tesla V100-SXM2-16GB', 'NVIDIA H100 80GB HBM3'); its total memory, when
    given, picks between variants of one family (A100 40/80 GB)."""
    name = re.sub(r"[^A-Z0-9]", "", device_name.upper())
    candidates: list[tuple[int, GpuType]] = []
    for g in list_gpus():
        family = re.sub(r"-(\d+GB|SXM|PCIE)$", "", g.name.upper())
        family = re.sub(r"[^A-Z0-9]", "", family)
        if family in name:  # 'A10' also matches 'A100…': the longest family wins below
            candidates.append((len(family), g))
    if not candidates:
        raise ClusterError(
            f"GPU {device_name!r} is not in the catalog; add it to "
            f"hardware/catalog.yaml with its data-sheet figures and sources."
        )
    longest = max(n for n, _ in candidates)
    matches = [g for n, g in candidates if n == longest]
    if len(matches) > 1:
        is_pcie = "PCIE" in name
        matches = [g for g in matches if ("PCIE" in g.name.upper()) == is_pcie] or matches
    if len(matches) > 1 and memory_bytes:
        matches.sort(key=lambda g: abs(g.memory_bytes - memory_bytes))
    elif len(matches) > 1:
        gb = re.search(r"(\d+)GB", device_name.upper().replace(" ", ""))
        if gb:
            gib = int(gb.group(1))
            matches.sort(key=lambda g: abs(g.memory_bytes / 2**30 - gib))
    return matches[0]


# -- which types run which precision fast (the --precision help) -----------------------------------


def precision_help() -> str:
    """The `--precision` help: every accepted value and, from the packaged catalog's peaks,
    which GPU types run each faster than fp32 (GpuType.accelerates; cost/precision.py)."""
    entries = _catalog_doc()["gpus"]
    parts = []
    for plan_p, p in list(CATALOG_PRECISION.items())[1:]:
        slow = [e["name"] for e in entries if not float(e["peak_tflops"].get(p) or 0) > float(e["peak_tflops"]["fp32"])]
        parts.append(f"{plan_p} on all but {', '.join(slow)}" if slow else f"{plan_p} on all")
    return (
        f"{' | '.join(CATALOG_PRECISION)}. Faster than fp32: {'; '.join(parts)}. Elsewhere a precision "
        f"runs at the card's fp32 rate (the plan says so); `heterog gpus` lists the rates."
    )
