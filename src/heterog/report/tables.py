"""HTML tables of the report: the placement (groups × devices) and the candidates.

Placement: consecutive groups with the same replicas and sync are one row (a plan of 300
groups usually has a handful of such runs), so the table stays short. Columns are devices
up to MAX_DEVICE_COLUMNS; beyond that they are nodes, with the node's devices' shares
summed, so a 1024-device plan reads as a table of its nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from heterog.fmt import human_bytes, human_time, human_usd
from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import Plan
from heterog.report.inputs import Candidate

MAX_DEVICE_COLUMNS = 64
TEXT_COLUMNS = 16  # up to this many columns the share is written in each cell


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Groups first..last (inclusive) that share one placement."""

    first: int
    last: int
    nodes: int
    shares: dict[str, float]  # device → share of each micro-batch
    sync: str
    ps_device: str | None
    recompute: bool


def segments(plan: Plan) -> list[Segment]:
    out: list[Segment] = []
    for i, g in enumerate(plan.groups):
        # a tensor-parallel set's members each compute the replica's samples (their slice of it)
        key = ({m: r.share for r in g.replicas for m in r.members}, g.sync, g.ps_device, g.recompute)
        prev = out[-1] if out else None
        if prev is not None and (prev.shares, prev.sync, prev.ps_device, prev.recompute) == key:
            out[-1] = Segment(
                first=prev.first,
                last=i,
                nodes=prev.nodes + len(g.nodes),
                shares=prev.shares,
                sync=prev.sync,
                ps_device=prev.ps_device,
                recompute=prev.recompute,
            )
        else:
            out.append(
                Segment(
                    first=i,
                    last=i,
                    nodes=len(g.nodes),
                    shares=key[0],
                    sync=g.sync,
                    ps_device=g.ps_device,
                    recompute=g.recompute,
                )
            )
    return out


def _columns(devices: Sequence[str], node_of: dict[str, str]) -> tuple[list[str], dict[str, str], str]:
    """(column names, device → column, what a column is)."""
    if len(devices) <= MAX_DEVICE_COLUMNS:
        return list(devices), {d: d for d in devices}, "device"
    cols = list(dict.fromkeys(node_of.get(d, d) for d in devices))
    return cols, {d: node_of.get(d, d) for d in devices}, "node"


def placement_table(plan: Plan, devices: Sequence[str], labels: dict[str, str], node_of: dict[str, str]) -> str:
    """Groups × devices (or nodes): each cell shaded by the share of the batch it computes."""
    cols, col_of, unit = _columns(devices, node_of)
    written = len(cols) <= TEXT_COLUMNS
    head = "".join(
        f'<th class="dev{"" if written else " vertical"}" title="{escape(c)}">{escape(labels.get(c, c))}</th>'
        for c in cols
    )
    body = []
    for s in segments(plan):
        per_col: dict[str, float] = {}
        for d, share in s.shares.items():
            per_col[col_of.get(d, d)] = per_col.get(col_of.get(d, d), 0.0) + share
        name = f"g{s.first}" if s.first == s.last else f"g{s.first}–g{s.last}"
        sync = s.sync if s.sync != SyncMethod.PS else f"ps on {labels.get(s.ps_device or '', s.ps_device)}"
        cells = []
        for c in cols:
            share = per_col.get(c, 0.0)
            tip = f"{name} on {c}: {100 * share:.1f} % of each micro-batch"
            text = f"{100 * share:.0f}" if written and share > 0 else ""
            style = f' style="--s:{min(share * 2.5, 1.0) if share else 0:.3f}"' if share else ""
            cells.append(f'<td class="share{" on" if share else ""}"{style} title="{escape(tip)}">{text}</td>')
        body.append(
            f'<tr><th class="grp">{name}</th><td class="num">{s.nodes}</td>'
            f"<td>{escape(sync)}{' · recompute' if s.recompute else ''}</td>{''.join(cells)}</tr>"
        )
    note = (
        "cells: % of each micro-batch"
        if written
        else f"cells shaded by share of each micro-batch (hover for the value); columns are {unit}s"
    )
    runs = f"{len(body)} run{'s' if len(body) != 1 else ''}"
    return (
        f'<table class="placement"><caption>{len(plan.groups)} groups in {runs} of equal placement '
        f"× {len(cols)} {unit}s — {note}</caption><thead><tr><th>groups</th><th>ops</th><th>sync</th>{head}"
        f"</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def _t(seconds: float | None) -> str:
    return human_time(seconds)


def candidates_table(cands: Sequence[Candidate], chosen: str) -> str:
    """Every strategy the planner scored: time, speed-up over even data parallelism (or the
    slowest feasible candidate when that does not fit), fits, peak memory."""
    feasible = [c for c in cands if c.feasible and c.iteration_time_s]
    ref = next((c for c in feasible if c.strategy == "even-dp-allreduce"), None)
    if ref is None and feasible:
        ref = max(feasible, key=lambda c: c.iteration_time_s or 0.0)
    rows = []
    priced = any(c.cost for c in cands)
    for c in cands:
        speed = (
            f"{ref.iteration_time_s / c.iteration_time_s:.2f}×"
            if ref is not None and ref.iteration_time_s and c.feasible and c.iteration_time_s
            else "—"
        )
        cls = ' class="chosen"' if c.strategy == chosen else ""
        rows.append(
            f'<tr{cls}><th>{escape(c.strategy)}</th><td class="num">'
            f'{_t(c.iteration_time_s) if c.feasible else "—"}</td><td class="num">{speed}</td>'
            f"<td>{'yes' if c.feasible else '<b class=bad>no (memory)</b>'}</td>"
            f'<td class="num">{c.devices_used}</td><td class="num">{c.num_microbatches}</td>'
            f'<td class="num">{human_bytes(c.max_peak_memory_bytes)}</td>{_cost_cells(c.cost, priced)}</tr>'
        )
    ref_name = ref.strategy if ref is not None else "—"
    unit = "tokens" if any("usd_per_million_tokens" in c.cost for c in cands) else "samples"
    cost_head = f"<th>$ per hour</th><th>$ per step</th><th>$ per million {unit}</th>" if priced else ""
    return (
        f'<table class="candidates"><caption>speed-up relative to {escape(ref_name)}; the chosen plan '
        f"is marked</caption><thead><tr><th>strategy</th><th>iteration</th><th>speed-up</th><th>fits</th>"
        f"<th>devices</th><th>micro-batches</th><th>max peak memory</th>{cost_head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _cost_cells(cost: dict[str, float], priced: bool) -> str:
    """A candidate's price per hour of its used devices, per step, per million samples or
    tokens (search/objective.py); '—' where a used device has no price."""
    if not priced:
        return ""
    if not cost:
        return '<td class="num">—</td>' * 3
    per = cost.get("usd_per_million_tokens", cost["usd_per_million_samples"])
    return "".join(f'<td class="num">{human_usd(v)}</td>' for v in (cost["usd_per_hour"], cost["usd_per_step"], per))


def cost_kpis(cost: dict[str, float]) -> list[tuple[str, str]]:
    """The plan's cost for the summary's figures (none when unpriced)."""
    if not cost:
        return []
    unit = "tokens" if "usd_per_million_tokens" in cost else "samples"
    per = cost.get("usd_per_million_tokens", cost["usd_per_million_samples"])
    return [("cost (planned)", f"{human_usd(cost['usd_per_hour'])} per hour, {human_usd(per)} per million {unit}")]
