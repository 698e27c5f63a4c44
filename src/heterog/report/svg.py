"""Plain inline SVG for the report: per-device timeline rows and memory rows.

No plotting library: the page must load with no network requests, and SVG written here is
a few hundred bytes per drawn bar. Colours are CSS classes (`k-forward`, …) defined by the
page, so light and dark mode change them without touching the drawing.

Size: a 64-device iteration can hold hundreds of thousands of simulated events; bars of
one kind closer than about half a pixel are merged first (`merge_intervals`), which bounds
the bars per row by the width in pixels and keeps the file small.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from math import floor, log10

from heterog.fmt import time_unit

LABEL_PX = 150
ROW_PX = 22
AXIS_PX = 22
MEM_ROW_MAX_PX = 34


@dataclass(frozen=True, kw_only=True, slots=True)
class Bar:
    kind: str  # a CSS class suffix: forward, backward, sync, …
    start_s: float
    end_s: float
    lane: int = 0  # 0: compute lane (tall), 1: communication lane (thin)
    title: str = ""  # its tooltip (an instruction's id); bars merged for size lose theirs


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    device: str
    label: str
    bars: tuple[Bar, ...]
    note: str = ""  # tooltip of the label (busy / idle times)


def merge_intervals(bars: Iterable[Bar], tolerance_s: float) -> list[Bar]:
    """Bars of the same kind and lane whose gap is at most tolerance_s merged into one."""
    out: list[Bar] = []
    open_: dict[tuple[str, int], Bar] = {}
    for b in sorted(bars, key=lambda b: (b.kind, b.lane, b.start_s)):
        key = (b.kind, b.lane)
        cur = open_.get(key)
        if cur is not None and b.start_s - cur.end_s <= tolerance_s:
            open_[key] = Bar(kind=cur.kind, lane=cur.lane, start_s=cur.start_s, end_s=max(cur.end_s, b.end_s), title="")
            continue
        if cur is not None:
            out.append(cur)
        open_[key] = b
    out.extend(open_.values())
    return out


def _nice_step(span: float, ticks: int = 6) -> float:
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** floor(log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt_time(t: float) -> str:
    if t == 0:
        return "0"
    factor, unit = time_unit(t)
    return f"{t * factor:g} {unit}"


def timeline_svg(rows: Sequence[Row], duration_s: float, *, width_px: int, title: str, css_id: str) -> str:
    """One row per device: compute bars in the upper lane, communication in the lower, the
    gaps are idle. A time axis on top."""
    plot = width_px - LABEL_PX - 28  # room for the last tick's label
    scale = plot / duration_s if duration_s > 0 else 0.0
    tol = duration_s / (2 * plot) if plot > 0 else 0.0
    h = AXIS_PX + ROW_PX * len(rows) + 4
    out = [
        f'<svg id="{css_id}" class="timeline" role="img" width="{width_px}" height="{h}" '
        f'viewBox="0 0 {width_px} {h}" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
    ]
    step = _nice_step(duration_s)
    t = 0.0
    while t <= duration_s * 1.0001 and step > 0:
        x = LABEL_PX + t * scale
        out.append(
            f'<line class="grid" x1="{x:.1f}" y1="{AXIS_PX - 4}" x2="{x:.1f}" y2="{h - 2}"/>'
            f'<text class="tick" x="{x:.1f}" y="{AXIS_PX - 8}">{_fmt_time(round(t, 12))}</text>'
        )
        t += step
    for i, row in enumerate(rows):
        y = AXIS_PX + i * ROW_PX
        out.append(
            f'<g class="device-row" data-device="{escape(row.device)}">'
            f'<rect class="lane-bg" x="{LABEL_PX}" y="{y + 2}" width="{plot}" height="{ROW_PX - 4}"/>'
            f'<text class="label" x="{LABEL_PX - 6}" y="{y + ROW_PX / 2 + 4}">{escape(row.label)}'
            f"<title>{escape(row.device + (': ' + row.note if row.note else ''))}</title></text>"
        )
        for b in merge_intervals(row.bars, tol):
            x = LABEL_PX + b.start_s * scale
            w = max((b.end_s - b.start_s) * scale, 0.6)
            by, bh = (y + 3, 11) if b.lane == 0 else (y + 15, 5)
            end = f"><title>{escape(b.title)}</title></rect>" if b.title else "/>"
            out.append(f'<rect class="k-{b.kind}" x="{x:.1f}" y="{by}" width="{w:.1f}" height="{bh}"{end}')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def downsample_peaks(points: Sequence[tuple[float, float]], duration_s: float, bins: int) -> list[tuple[float, float]]:
    """A step function (time, bytes) reduced to at most `bins` points, each the largest value
    in its bin, so the peak is never lost."""
    if len(points) <= bins or duration_s <= 0:
        return list(points)
    best: dict[int, tuple[float, float]] = {}
    for t, b in points:
        k = min(int(t / duration_s * bins), bins - 1)
        if k not in best or b > best[k][1]:
            best[k] = (t, b)
    return [best[k] for k in sorted(best)]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRow:
    device: str
    label: str
    points: tuple[tuple[float, float], ...]  # (time_s, bytes) steps over the iteration
    peak_bytes: int
    capacity_bytes: int
    text: str  # e.g. "12.3 / 16.0 GiB (77 %)"


def memory_scale_bytes(rows: Sequence[MemoryRow]) -> float:
    """One vertical scale for every row, so rows compare: up to the largest capacity, but no
    further than 1.3 × the largest peak (a plan using 15 % of its memory still shows its shape)."""
    peak = max((r.peak_bytes for r in rows), default=0)
    cap = max((r.capacity_bytes for r in rows), default=0)
    return max(min(cap, 1.3 * peak), peak, 1.0)


def memory_svg(rows: Sequence[MemoryRow], duration_s: float, *, width_px: int) -> str:
    """Memory in use over the iteration, one row per device, on one scale (memory_scale_bytes);
    a dashed line marks a device's capacity where it lies within the scale, and a row over
    capacity is drawn in the overflow colour."""
    text_px = 190
    plot = width_px - LABEL_PX - text_px - 8
    full = memory_scale_bytes(rows)
    MEM_ROW_PX = MEM_ROW_MAX_PX if len(rows) <= 16 else ROW_PX  # noqa: N806 - 64 rows stay on a screen or two
    h = MEM_ROW_PX * len(rows) + 4
    out = [
        f'<svg id="memory" class="memory" role="img" width="{width_px}" height="{h}" '
        f'viewBox="0 0 {width_px} {h}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>memory in use over one iteration, per device, against its capacity</title>"
    ]
    for i, r in enumerate(rows):
        y0 = 2 + i * MEM_ROW_PX
        top, base = y0 + 2, y0 + MEM_ROW_PX - 3
        over = r.peak_bytes > r.capacity_bytes

        def ypos(b: float, base: float = base, top: float = top) -> float:
            return base - (base - top) * b / full

        pts = downsample_peaks(r.points, duration_s, max(plot, 1))
        path = [f"M{LABEL_PX},{base}"]
        last_y: float = base
        for t, b in pts:
            x = LABEL_PX + (t / duration_s if duration_s > 0 else 0) * plot
            path.append(f"L{x:.1f},{last_y:.1f}L{x:.1f},{ypos(b):.1f}")
            last_y = ypos(b)
        path.append(f"L{LABEL_PX + plot},{last_y:.1f}L{LABEL_PX + plot},{base}Z")
        cap_line = (
            f'<line class="cap" x1="{LABEL_PX}" y1="{ypos(r.capacity_bytes):.1f}" x2="{LABEL_PX + plot}" '
            f'y2="{ypos(r.capacity_bytes):.1f}"/>'
            if r.capacity_bytes <= full
            else ""
        )
        out.append(
            f'<g class="memory-row" data-device="{escape(r.device)}">'
            f'<rect class="lane-bg" x="{LABEL_PX}" y="{top}" width="{plot}" height="{base - top}"/>'
            f'<path class="{"mem-over" if over else "mem"}" d="{"".join(path)}"/>'
            f"{cap_line}"
            f'<text class="label" x="{LABEL_PX - 6}" y="{y0 + MEM_ROW_PX / 2 + 3}">{escape(r.label)}</text>'
            f'<text class="memtext{" bad" if over else ""}" x="{LABEL_PX + plot + 8}" '
            f'y="{y0 + MEM_ROW_PX / 2 + 3}">{escape(r.text)}</text></g>'
        )
    out.append("</svg>")
    return "".join(out)
