"""Reading a cluster YAML document field by field: mappings that remember their lines, so
every error names the file, line and field; numbers, bandwidths (three units) and latencies
(two) read and checked; and the plausible range of each figure, outside which a value is an
error (a unit slip) or a warning (unusual hardware). hardware/spec.py reads the document
with these."""

from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import dataclass
from typing import Any

import yaml

from heterog.errors import ClusterError, HeterogWarning

# -- plausible ranges -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Plausible:
    """Outside [error_low, error_high] a figure is surely a unit slip (an error); outside
    [warn_low, warn_high] it is unusual for real hardware (a warning). SI units."""

    what: str
    unit: str
    scale: float  # SI value / scale = the figure in `unit`, for messages
    error_low: float
    warn_low: float
    warn_high: float
    error_high: float


# Anchors: 1 Gbit/s Ethernet to NVLink 5 (1.8 TB/s per GPU, nvidia.com/nvlink); GPU memory
# from 1 GiB to the 288 GB of a B300 (nvidia.com); NIC latencies of µs (RDMA) to ms (WAN).
BANDWIDTH = Plausible(
    what="bandwidth", unit="Gbit/s", scale=1e9 / 8, error_low=1e5, warn_low=1.25e8, warn_high=2e12, error_high=1e13
)
MEMORY = Plausible(
    what="memory", unit="GiB", scale=2**30, error_low=2**26, warn_low=2**30, warn_high=2**39, error_high=2**42
)
LATENCY = Plausible(what="latency", unit="µs", scale=1e-6, error_low=0.0, warn_low=0.0, warn_high=10e-3, error_high=1.0)
# Host speed relative to the machine the catalog's host costs were fitted on: hosts of
# training GPUs differ by a few × (CPU generation, clock, Python build, load), not by 100×.
HOST_SPEED = Plausible(
    what="host speed", unit="×", scale=1.0, error_low=0.01, warn_low=0.2, warn_high=5.0, error_high=100.0
)
SLOWDOWN = Plausible(
    what="slowdown", unit="×", scale=1.0, error_low=1e-3, warn_low=0.05, warn_high=100.0, error_high=1000.0
)


def plausible(ctx: Ctx, where: str, m: Any, key: str, value: float, rng: Plausible) -> float:
    """Return value; raise ClusterError outside the error range, warn outside the usual one."""
    shown = f"{value / rng.scale:.4g} {rng.unit}"
    span = f"{rng.warn_low / rng.scale:.4g}–{rng.warn_high / rng.scale:.4g} {rng.unit}"
    if not rng.error_low <= value <= rng.error_high:
        raise ctx.fail(
            where,
            m,
            key,
            f"{rng.what} {shown} is implausible (real hardware lies within {span}); check the unit in the field name.",
        )
    if not rng.warn_low <= value <= rng.warn_high:
        warnings.warn(
            HeterogWarning(
                ctx.fail(where, m, key, f"{rng.what} {shown} is outside the usual {span}; is the unit right?").args[0]
            ),
            stacklevel=2,
        )
    return value


# -- YAML with line numbers -------------------------------------------------------------------


class LineMap(dict):
    """A mapping that remembers the line of each key (1-based) and of itself."""

    line: int | None = None
    key_lines: dict[str, int]


class LineLoader(yaml.SafeLoader):
    pass


def _construct_map(loader: LineLoader, node: yaml.MappingNode) -> LineMap:
    out = LineMap()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise ClusterError(
                f"line {key_node.start_mark.line + 1}: field {key!r} appears twice in one mapping; keep one."
            )
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


class Ctx:
    """Where we are in the document, to name it in errors."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, mapping: Any, key: str | None, message: str) -> ClusterError:
        line = None
        if isinstance(mapping, LineMap):
            line = mapping.key_lines.get(key, mapping.line) if key is not None else mapping.line
        loc = f"{self.source}:{line}" if line else self.source
        field = f"{where}.{key}" if key and where else (key or where or "(top)")
        return ClusterError(f"{loc}: field {field}: {message}")


def check_keys(ctx: Ctx, where: str, m: Any, allowed: set[str]) -> None:
    if not isinstance(m, dict):
        raise ctx.fail(where, None, None, f"expected a mapping, found {type(m).__name__} {m!r}.")
    for k in m:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), sorted(allowed), n=2, cutoff=0.5)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ctx.fail(where, m, k, f"unknown field.{hint} Allowed: {', '.join(sorted(allowed))}.")


def number(ctx: Ctx, where: str, m: dict, key: str, *, positive: bool = True) -> float:
    v = m[key]
    if isinstance(v, str):  # YAML 1.1 reads 1e11 (no dot, no sign) as text
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ctx.fail(where, m, key, f"expected a finite number, found {v!r}.")
    if positive and v <= 0:
        raise ctx.fail(where, m, key, f"must be > 0, found {v!r}; a link or size cannot be zero or negative.")
    if not positive and v < 0:
        raise ctx.fail(where, m, key, f"must be ≥ 0, found {v!r}.")
    return float(v)


def bandwidth(ctx: Ctx, where: str, m: dict, stem: str, default: float | None) -> float | None:
    """Bytes per second from stem_gbps (bits), stem_gbytes_per_s or stem_bytes_per_s."""
    given = [k for k in (f"{stem}_gbps", f"{stem}_gbytes_per_s", f"{stem}_bytes_per_s") if k in m]
    if len(given) > 1:
        raise ctx.fail(where, m, given[1], f"give the bandwidth once (found {', '.join(given)}).")
    if not given:
        return default
    k = given[0]
    v = number(ctx, where, m, k)
    v = v * 1e9 / 8 if k.endswith("_gbps") else v * 1e9 if k.endswith("_gbytes_per_s") else v
    return plausible(ctx, where, m, k, v, BANDWIDTH)


def latency(ctx: Ctx, where: str, m: dict, stem: str, default: float) -> float:
    if f"{stem}_us" in m and f"{stem}_s" in m:
        raise ctx.fail(where, m, f"{stem}_s", "give the latency once, in _us or in _s.")
    if f"{stem}_us" in m:
        return plausible(
            ctx, where, m, f"{stem}_us", number(ctx, where, m, f"{stem}_us", positive=False) * 1e-6, LATENCY
        )
    if f"{stem}_s" in m:
        return plausible(ctx, where, m, f"{stem}_s", number(ctx, where, m, f"{stem}_s", positive=False), LATENCY)
    return default
