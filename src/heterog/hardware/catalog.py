"""The GPU catalog (catalog.yaml: data sheets with their sources) and the `cpu` device type,
whose rates are measured on this machine by a short probe and cached.

`get_gpu(name)` is the one way to turn a type name into a GpuType. Matching ignores case and
separators, reads '80g' as '80GB' and knows each type's other spellings (`aka`); a name that
several types share (a family: 'A100', 'V100', 'H100') is refused with the types it could
mean, and an unknown one gets the close names — never a silent guess. A catalog type without
measurements gets its efficiency from its public figures (cost/public_model.py).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import platform
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from heterog.cachedir import cache_dir as user_cache_dir
from heterog.errors import ClusterError
from heterog.hardware.gputype import PRECISIONS, Efficiency, GpuType, HostCosts, PublicFigures
from heterog.jsonio import write_atomic

CPU_TYPE = "cpu"
# glibc malloc's largest dynamic mmap threshold on 64-bit (mallopt(3), DEFAULT_MMAP_THRESHOLD_MAX):
# larger allocations always get freshly mapped pages.
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20
_PROBE_VERSION = 9


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


def gpu_from_entry(e: dict[str, Any], where: str = "catalog.yaml") -> GpuType:
    """A catalog entry as a GpuType; without an `efficiency` of its own (no measurements),
    its efficiency derived from its public figures (cost/public_model.py)."""
    where = f"{where}: GPU type {e.get('name', '?')!r}"
    gpu = _gpu_type_of(e, where)
    if e.get("efficiency") or gpu.public is None:
        return gpu
    from heterog.cost.public_model import derive

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


# -- the `cpu` device type, measured -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuProbe:
    """Rates of this machine's CPU under the current torch thread count."""

    key: str  # cpu model | threads | torch version
    matmul_flops_per_s: dict[int, float]  # square fp32 size n → achieved FLOP/s
    bf16_matmul_flops_per_s: float
    conv_flops_per_s: float  # 3×3 and 1×1 convolutions, forward (geometric mean)
    copy_bandwidth_bytes_per_s: float  # bytes read + written per second
    # achieved bytes (inputs + outputs) per second of memory-bound kinds, by OpGraph kind:
    # CPU batch norm, pooling and softmax run far below copy bandwidth
    kind_bandwidth_bytes_per_s: dict[str, float]
    fresh_page_s_per_byte: float  # first touch of newly mapped memory (page faults)
    # forward time per output element of ops whose cost is neither FLOPs nor bytes on a CPU:
    # dropout's random numbers, GELU's erf (by module type, see cost.analytic)
    element_s: dict[str, float]
    dispatch_s: float  # one small op with autograd recording
    backward_dispatch_s: float  # one small op's backward in the autograd engine
    memory_bytes: int

    @property
    def peak_flops_per_s(self) -> float:
        return max(self.matmul_flops_per_s.values())


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe_key(threads: int) -> str:
    import torch

    return f"{_cpu_model_name()}|threads={threads}|torch={torch.__version__}|v{_PROBE_VERSION}"


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` for the body; the caller's after it."""
    import torch

    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def cache_dir() -> Path:
    return user_cache_dir()


def _best_time_s(fn, *, repeats: int, min_time_s: float = 0.0) -> float:
    """The fastest of `repeats` runs: on a shared machine the least-disturbed run is the
    closest to the device's own speed (HeteroG profiled the same way: min of 5 runs)."""
    import torch

    # One torch thread: its own CPU time, which other processes on a shared machine do not
    # inflate. Several threads: wall time (the fastest run is the least disturbed).
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up (allocations, one-time kernel selection)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time_s:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) > 50 * repeats:
            break
    return min(times)


def _run_probe() -> CpuProbe:
    """About one second of matmuls, a convolution, a copy and tiny ops under autograd."""
    import psutil
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        mm: dict[int, float] = {}
        for n in (64, 128, 256, 512, 1024):
            a, b = torch.randn(n, n), torch.randn(n, n)
            t = _best_time_s(lambda: torch.mm(a, b), repeats=5 if n >= 512 else 20)
            mm[n] = 2 * n**3 / t
        a16, b16 = torch.randn(512, 512).bfloat16(), torch.randn(512, 512).bfloat16()
        bf16 = 2 * 512**3 / _best_time_s(lambda: torch.mm(a16, b16), repeats=3)
        x, w = torch.randn(8, 64, 32, 32), torch.randn(64, 64, 3, 3)
        conv3 = 2 * 8 * 64 * 32 * 32 * 64 * 9 / _best_time_s(lambda: F.conv2d(x, w, padding=1), repeats=5)
        x1, w1 = torch.randn(8, 256, 32, 32), torch.randn(64, 256, 1, 1)
        conv1 = 2 * 8 * 64 * 32 * 32 * 256 / _best_time_s(lambda: F.conv2d(x1, w1), repeats=5)
        # oneDNN runs 3×3 convolutions with Winograd-like tricks, 1×1 as plain GEMMs: the
        # graph does not say which a node is, so the geometric mean stands for both
        conv = (conv3 * conv1) ** 0.5
        src = torch.randn(16 * 2**20 // 4 * 4)  # 64 MiB: larger than any last-level cache here
        dst = torch.empty_like(src)
        copy = 2 * src.numel() * 4 / _best_time_s(lambda: dst.copy_(src), repeats=5)
        # memory-bound kinds on an activation-sized tensor (12.5 MiB), bytes as the capture
        # counts them: inputs + outputs (+ max-pool indices)
        act = torch.randn(8, 64, 80, 80)
        nb = act.numel() * 4
        rm, rv = torch.zeros(64), torch.ones(64)
        kinds = {
            "norm": 2 * nb / _best_time_s(lambda: F.batch_norm(act, rm, rv, training=True), repeats=3),
            "pool": (nb + nb / 4 * 3) / _best_time_s(lambda: F.max_pool2d_with_indices(act, 3, 2, 1), repeats=3),
            "elementwise": 2 * nb / _best_time_s(lambda: F.relu(act), repeats=3),
            "attention": 2 * nb / _best_time_s(lambda: torch.softmax(act, dim=-1), repeats=3),
        }
        # the optimizer's element-wise updates stream parameter-sized tensors from memory
        c = torch.randn_like(src)
        kinds["optimizer"] = 4 * src.numel() * 4 / _best_time_s(lambda: dst.addcmul_(src, c, value=0.1), repeats=3)
        elements = {
            "dropout": _best_time_s(lambda: F.dropout(act, 0.1, training=True), repeats=3) / act.numel(),
            "gelu": _best_time_s(lambda: F.gelu(act), repeats=3) / act.numel(),
        }
        # glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh pages
        # every time; the kernel's page faults and zeroing cost far more than the writes
        fill_s = _best_time_s(lambda: dst.fill_(1.0), repeats=3)
        fresh_s = _best_time_s(lambda: torch.empty_like(src).fill_(1.0), repeats=3)
        fresh_page = max(fresh_s - fill_s, 0.0) / (src.numel() * 4)
    # backward of the same kinds: input gradient from output gradient (+ saved tensors)
    x = act.clone().requires_grad_()
    for kind, fn, nbytes in (
        ("norm", lambda t: F.batch_norm(t, rm, rv, training=True), 3 * nb),
        ("pool", lambda t: F.max_pool2d(t, 3, 2, 1), nb * 1.75),
        ("elementwise", F.relu, 3 * nb),
        ("attention", lambda t: torch.softmax(t, dim=-1), 3 * nb),
    ):
        y = fn(x)
        g = torch.ones_like(y)
        kinds[f"{kind}.bwd"] = nbytes / _best_time_s(lambda: torch.autograd.grad(y, x, g, retain_graph=True), repeats=3)
    p = torch.ones(4, requires_grad=True)
    q = torch.ones(4)
    chain = 200

    def forward_chain():
        y = p
        for _ in range(chain):
            y = y * q
        return y

    fwd_s = _best_time_s(forward_chain, repeats=5) / chain
    total_s = _best_time_s(lambda: forward_chain().sum().backward(), repeats=5) / chain
    return CpuProbe(
        key=_probe_key(torch.get_num_threads()),
        matmul_flops_per_s=mm,
        bf16_matmul_flops_per_s=bf16,
        conv_flops_per_s=conv,
        copy_bandwidth_bytes_per_s=copy,
        kind_bandwidth_bytes_per_s=kinds,
        fresh_page_s_per_byte=fresh_page,
        element_s=elements,
        dispatch_s=fwd_s,
        backward_dispatch_s=max(total_s - fwd_s, 0.2 * fwd_s),
        memory_bytes=int(psutil.virtual_memory().total),
    )


@lru_cache(maxsize=4)
def _measure_cpu_for(key: str, threads: int) -> CpuProbe:
    path = cache_dir() / "cpu_probe.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    if isinstance(entry, dict):
        try:
            entry = dict(entry)
            entry["matmul_flops_per_s"] = {int(k): float(v) for k, v in entry["matmul_flops_per_s"].items()}
            return CpuProbe(**entry)
        except (TypeError, KeyError, ValueError):
            pass  # a stale or damaged entry: measure again
    with torch_threads(threads):
        probe = _run_probe()
    doc = {k: v for k, v in cached.items()} if isinstance(cached, dict) else {}
    body = {f: getattr(probe, f) for f in probe.__dataclass_fields__}
    body["matmul_flops_per_s"] = {str(k): v for k, v in probe.matmul_flops_per_s.items()}
    doc[key] = body
    try:
        write_atomic(path, json.dumps(doc, indent=1))
    except OSError:
        pass  # a read-only home: the probe is cheap enough to repeat next time
    return probe


def measure_cpu(threads: int | None = None) -> CpuProbe:
    """This machine's CPU rates at `threads` torch threads (None: the caller's count), cached
    under ~/.cache/heterog (or $HETEROG_CACHE_DIR) and measured again when the CPU model,
    the thread count or torch's version changes. Measuring sets the count for the probe only:
    the caller's is left as it was."""
    import torch

    n = threads or torch.get_num_threads()
    return _measure_cpu_for(_probe_key(n), n)


def cpu_gpu_type(threads: int | None = None) -> GpuType:
    """The `cpu` device type: this CPU's rates at `threads` torch threads (None: the caller's
    count), recorded in the type (`cpu_threads`) so that every cost of it uses the same probe."""
    import torch

    n = threads or torch.get_num_threads()
    p = measure_cpu(n)
    fp32 = p.peak_flops_per_s
    return GpuType(
        name=CPU_TYPE,
        vendor="cpu",
        peak_flops_per_s={"fp32": fp32, "tf32": 0.0, "fp16": 0.0, "bf16": p.bf16_matmul_flops_per_s},
        memory_bandwidth_bytes_per_s=p.copy_bandwidth_bytes_per_s,
        memory_bytes=p.memory_bytes,
        intra_node_link="loopback",
        cpu_threads=n,
        # gloo between local processes: shared-memory copies through the loopback interface
        intra_node_bandwidth_bytes_per_s=2e9,
        sources={
            "peak_flops_per_s": f"measured on this machine ({p.key})",
            "memory_bandwidth_bytes_per_s": "measured: 64 MiB copy, bytes read + written",
            "intra_node_link": "gloo point-to-point between processes of one machine, ~2 GB/s "
            "(profile/links.py measures a machine's own)",
        },
    )


def gpu_from_device_name(device_name: str, memory_bytes: int | None = None) -> GpuType:
    """The catalog type of a physical device, from torch.cuda.get_device_name() (e.g. 'NVIDIA
    A100-SXM4-80GB', 'Tesla V100-SXM2-16GB', 'NVIDIA H100 80GB HBM3'); its total memory, when
    given, picks between variants of one family (A100 40/80 GB)."""
    import re

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
    family = [g for n, g in candidates if n == longest]
    if len(family) > 1:
        is_pcie = "PCIE" in name
        by_form = [g for g in family if ("PCIE" in g.name.upper()) == is_pcie] or family
        family = by_form
    if len(family) > 1 and memory_bytes:
        family.sort(key=lambda g: abs(g.memory_bytes - memory_bytes))
    elif len(family) > 1:
        gb = re.search(r"(\d+)GB", device_name.upper().replace(" ", ""))
        if gb:
            family.sort(key=lambda g: abs(g.memory_bytes / 2**30 - int(gb.group(1))))
    return family[0]


# -- which types run which precision fast (the --precision help) -----------------------------------

PLAN_PRECISIONS = {"fp32": "fp32", "tf32": "tf32", "amp-bf16": "bf16", "fp16": "fp16"}


def precision_help() -> str:
    """The `--precision` help: every accepted value and, from the packaged catalog's peaks,
    which GPU types run each faster than fp32 (GpuType.accelerates; cost/precision.py)."""
    entries = _catalog_doc()["gpus"]
    parts = []
    for plan_p, p in list(PLAN_PRECISIONS.items())[1:]:
        slow = [e["name"] for e in entries if not float(e["peak_tflops"].get(p) or 0) > float(e["peak_tflops"]["fp32"])]
        parts.append(f"{plan_p} on all but {', '.join(slow)}" if slow else f"{plan_p} on all")
    return (
        f"{' | '.join(PLAN_PRECISIONS)}. Faster than fp32: {'; '.join(parts)}. Elsewhere a precision "
        f"runs at the card's fp32 rate (the plan says so); `heterog gpus` lists the rates."
    )
