"""The report's per-instruction section: a run's prediction beside its measurement for the
same Program instructions (ir/run_result.py InstructionTiming, joined by instruction id).

Three views: per device and instruction kind the predicted and measured time, the largest
misses first; the single instructions that missed most; and per device two timeline rows —
simulated, then measured (the step shown) — whose bars are the same instructions, each bar's
tooltip naming its instruction id.
"""

from __future__ import annotations

from html import escape

from heterog.fmt import human_time
from heterog.ir.kinds import InstructionKind
from heterog.ir.run_result import InstructionTiming, RunResult
from heterog.report import svg

TABLE_ROWS = 16
WORST = 8
MAX_DEVICES = 16  # device pairs of rows drawn (a local run has at most 16 ranks)

# instruction → (CSS kind, lane): compute and the optimizer in the upper lane
_DRAWN = {
    InstructionKind.SEND: ("transfer", 1),
    InstructionKind.RECV: ("transfer", 1),
    InstructionKind.COLLECTIVE: ("sync", 1),
    InstructionKind.OPTIMIZER: ("optimizer", 0),
}


def _bar(i: InstructionTiming, start: float | None, end: float | None) -> svg.Bar | None:
    if start is None or end is None:
        return None
    kind, lane = _DRAWN.get(i.kind, (i.label, 0))
    return svg.Bar(kind=kind, start_s=start, end_s=end, lane=lane, title=f"{i.id}: {i.name}")


def _rows(run: RunResult) -> tuple[list[svg.Row], float]:
    rows: list[svg.Row] = []
    length = 0.0
    for d in run.devices[:MAX_DEVICES]:
        mine = [i for i in run.instructions if i.device == d]
        simulated = [b for i in mine if (b := _bar(i, i.predicted_start_s, i.predicted_end_s))]
        measured = [b for i in mine if (b := _bar(i, i.measured_start_s, i.measured_end_s))]
        length = max([length, *(b.end_s for b in simulated), *(b.end_s for b in measured)])
        rows.append(svg.Row(device=d, label=f"{d} simulated", bars=tuple(simulated)))
        rows.append(svg.Row(device=d, label=f"{d} measured", bars=tuple(measured)))
    return rows, length


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "−") + human_time(abs(seconds))


def _kind_table(run: RunResult) -> str:
    rows = run.by_kind()
    body = "".join(
        f"<tr><td>{escape(r.device)}</td><td>{escape(r.kind)}</td><td class=num>{r.count}</td>"
        f"<td class=num>{human_time(r.predicted_s)}</td><td class=num>{human_time(r.measured_s)}</td>"
        f'<td class="num{" bad" if r.miss_s > 0 else ""}">{_signed(r.miss_s)}</td></tr>'
        for r in rows[:TABLE_ROWS]
    )
    more = f"<p class=muted>{len(rows) - TABLE_ROWS} more rows in the run file.</p>" if len(rows) > TABLE_ROWS else ""
    return (
        "<table id=by-kind><caption>per device and instruction kind, summed (largest misses first)</caption>"
        "<thead><tr><th>device</th><th>kind</th><th>count</th><th>predicted</th><th>measured</th><th>miss</th>"
        f"</tr></thead><tbody>{body}</tbody></table>{more}"
    )


def _worst_table(run: RunResult) -> str:
    body = "".join(
        f"<tr><td><code>{escape(i.id)}</code></td><td>{escape(i.name)}</td>"
        f"<td class=num>{human_time(i.predicted_s)}</td><td class=num>{human_time(i.measured_s)}</td>"
        f"<td class=num>{_signed(i.miss_s or 0.0)}</td></tr>"
        for i in run.largest_misses(WORST)
    )
    return (
        "<table id=worst-instructions><caption>the instructions that missed most</caption><thead><tr>"
        "<th>instruction</th><th>what</th><th>predicted</th><th>measured</th><th>miss</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def instruction_section(run: RunResult | None) -> str:
    """The section, or nothing when the run has no per-instruction record or no prediction."""
    if run is None or not run.instructions or not run.by_kind():
        return ""
    rows, length = _rows(run)
    timeline = svg.timeline_svg(
        rows, length, width_px=1140, title="the same instructions, simulated and measured", css_id="timeline-pairs"
    )
    cut = f" The first {MAX_DEVICES} of {len(run.devices)} devices are drawn." if len(run.devices) > MAX_DEVICES else ""
    return (
        "<h2>Per instruction: predicted vs measured</h2><p class=muted>Every Program instruction is named by "
        "its id (op@device) in the Program, the simulated trace and the measured one. Measured times are the "
        f"median over {run.measured_steps} steps; a compute is its forward or backward, a send its posting, a "
        "receive its wait for the data (so a transfer's time shows at its receiver), a collective its run on "
        "the rank's communication lane, the optimizer instruction its step.</p>"
        + _kind_table(run)
        + _worst_table(run)
        + f"<h3>The same instructions, simulated and measured (step {run.shown_step})</h3><p class=muted>Per "
        "device, its simulated iteration above its measured step, on one time axis; hover a bar for its "
        f"instruction.{cut}</p>" + f'<div class="scroll">{timeline}</div>'
    )
