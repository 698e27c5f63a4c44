"""How heterog writes quantities for people: bytes, durations, FLOPs and prices with their units.

The command line, the HTML report and the plan explanations all print through these, so a
time reads the same everywhere; this module imports nothing of heterog, so any layer may use it.
"""

from __future__ import annotations

import math


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def time_unit(seconds: float) -> tuple[float, str]:
    """(factor, unit) to show a duration in: s from 1 s, ms from 1 ms, µs below. One rule
    for every time heterog prints, the report's axis ticks included."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


_TIME_DECIMALS = {"s": 3, "ms": 2, "µs": 1}


def human_time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    factor, unit = time_unit(seconds)
    return f"{seconds * factor:.{_TIME_DECIMALS[unit]}f} {unit}"


def human_flops(f: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= size:
            return f"{f / size:.2f} {unit}"
    return f"{f:.0f} FLOP"


def human_usd(usd: float) -> str:
    """US dollars: cents from $0.01 (thousands grouped), three significant figures below (a
    step or a small model's million samples can cost a fraction of a cent)."""
    if usd == 0 or abs(usd) >= 0.01:
        return f"${usd:,.2f}"
    return f"${usd:.3g}"
