"""Plan + SimResult (+ candidates, + a measured run) → the HTML report.

The page, top to bottom: what was planned and how long it takes; the bottleneck in three
sentences; a timeline of one iteration per device (simulated, and measured beside it when a
run is given); memory over the iteration against each device's capacity; the placement;
the candidates; and, with a run, how its prediction relates to this one and, instruction by
instruction, where the prediction missed (report/instructions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from heterog.fmt import human_bytes, human_time
from heterog.hardware.cluster import Cluster
from heterog.ir.plan import Plan
from heterog.ir.run_result import RunResult, SpanCategory
from heterog.report import bottleneck, page, svg, tables
from heterog.report.inputs import Candidate
from heterog.report.instructions import instruction_section
from heterog.simulate.result import SimResult

MAX_TIMELINE_ROWS = 128  # above this many devices, the busiest MAX_TIMELINE_ROWS // 2 are drawn
COMPUTE_KINDS = ("forward", "backward", "optimizer", "compute")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportInputs:
    plan: Plan
    sim: SimResult
    cluster: Cluster
    candidates: tuple[Candidate, ...] = ()
    run: RunResult | None = None


def _rows_shown(inp: ReportInputs) -> tuple[list[str], str]:
    """The devices drawn (cluster order) and a note when some are left out. Above
    MAX_TIMELINE_ROWS devices, one row per node (its busiest device), so every node and every
    pipeline stage stays in view; with more nodes than that, the busiest devices."""
    devices = [d.name for d in inp.cluster.devices]  # unused ones too: an idle row is a finding
    if len(devices) <= MAX_TIMELINE_ROWS:
        return devices, ""
    idle = inp.sim.idle_time_s
    by_node: dict[str, list[str]] = {}
    for d in devices:
        by_node.setdefault(inp.cluster.node_of[d], []).append(d)
    if len(by_node) <= MAX_TIMELINE_ROWS:
        keep = [min(ds, key=lambda d: (idle.get(d, float("inf")), d)) for ds in by_node.values()]
        return keep, (
            f"one row per node ({len(by_node)} nodes, {len(devices)} devices): each node's busiest "
            f"device (least idle time)"
        )
    busy = [d for d in devices if d in idle]
    kept = set(sorted(busy, key=lambda d: idle[d])[: MAX_TIMELINE_ROWS // 2])
    return (
        [d for d in devices if d in kept],
        f"showing the {len(kept)} busiest of {len(devices)} devices (least idle time)",
    )


def _sim_rows(inp: ReportInputs, devices: Sequence[str]) -> list[svg.Row]:
    bars: dict[str, list[svg.Bar]] = {d: [] for d in devices}
    for _name, cat, track, s, e, _op in inp.sim.events:
        if track in bars:
            bars[track].append(svg.Bar(kind=cat, start_s=s, end_s=e, lane=0 if cat in COMPUTE_KINDS else 1))
    used = set(inp.plan.devices())
    rows = []
    for d in devices:
        gpu = inp.cluster.device(d).gpu_type
        note = (
            f"{gpu}; compute {human_time(inp.sim.compute_time_s.get(d))}, communication "
            f"{human_time(inp.sim.communication_time_s.get(d))}, idle {human_time(inp.sim.idle_time_s.get(d))}"
        )
        rows.append(svg.Row(device=d, label=d if d in used else f"{d} (unused)", bars=tuple(bars[d]), note=note))
    return rows


# a measured span's category → the timeline's kind (its CSS class): the lane's runs are syncs
_MEASURED_KIND = {SpanCategory.COLLECTIVE: "sync", SpanCategory.TENSOR_PARALLEL: "tp"}


def _measured_rows(run: RunResult, devices: Sequence[str]) -> tuple[list[svg.Row], float, int]:
    """The rows of the run's shown step (the median one; the first step is warm-up when
    there are others)."""
    step = run.shown_step if run.shown_step is not None else max(s.step for s in run.spans)
    spans = [s for s in run.spans if s.step == step]
    t0 = min(s.start_s for s in spans)
    t1 = max(s.end_s for s in spans)
    bars: dict[str, list[svg.Bar]] = {d: [] for d in devices}
    for s in spans:
        device = run.devices[s.rank]
        if s.category is not SpanCategory.STEP and device in bars:
            kind = _MEASURED_KIND.get(s.category, str(s.category))
            bars[device].append(
                svg.Bar(kind=kind, start_s=s.start_s - t0, end_s=s.end_s - t0, lane=0 if kind in COMPUTE_KINDS else 1)
            )
    ran = {run.devices[s.rank] for s in spans}
    return (
        [svg.Row(device=d, label=d if d in ran else f"{d} (no rank)", bars=tuple(bars[d])) for d in devices],
        t1 - t0,
        step,
    )


def _summary(inp: ReportInputs) -> str:
    p, s = inp.plan, inp.sim
    model = p.model.name + (f", seq_len {p.model.seq_len}" if p.model.seq_len else "")
    fits = (
        "fits in memory"
        if s.feasible
        else f'<b class="bad">does not fit: {escape(str(s.overflow_device))} needs '
        f"{human_bytes(s.overflow_bytes)} more</b>"
    )
    kpis = [
        ("iteration (simulated)", human_time(s.iteration_time_s)),
        ("throughput", f"{s.throughput_samples_per_s:,.1f} samples/s"),
        ("devices used", f"{len(p.devices())} of {len(inp.cluster.devices)}"),
        ("groups", str(len(p.groups))),
        ("micro-batches", f"{p.num_microbatches} ({p.schedule})"),
        *tables.cost_kpis(p.predicted_cost),
    ]
    k = "".join(f"<div>{escape(a)}<b>{escape(b)}</b></div>" for a, b in kpis)
    fits += _recorded_prediction(p, s)
    notes = "".join(f"<li>{escape(n)}</li>" for n in p.notes)
    return (
        f"<h1>{escape(p.strategy)} plan: {escape(model)}, batch {p.batch_size}, on {escape(inp.cluster.name)}</h1>"
        f'<p class="muted">{escape(p.precision)}, {escape(p.optimizer)}; {fits}.</p><div class="kpis">{k}</div>'
        + (f"<details><summary>why this plan (planner's notes)</summary><ul>{notes}</ul></details>" if notes else "")
    )


def _recorded_prediction(plan: Plan, sim: SimResult) -> str:
    """A plan records the time the planner predicted; say so when this simulation differs, since
    then the cost model, the catalog or the cluster spec changed between planning and now."""
    rec = plan.predicted_iteration_time_s
    if rec is None or sim.iteration_time_s <= 0 or abs(rec - sim.iteration_time_s) <= 0.01 * sim.iteration_time_s:
        return ""
    return (
        f'. <b class="bad">The plan file records {human_time(rec)} (the planner\'s prediction); this '
        f"simulation gives {human_time(sim.iteration_time_s)}: the cost model, GPU catalog or cluster spec "
        f"differ from when it was planned, so the candidates table (planner's figures) and this page's "
        f"timelines (today's) do not agree; re-plan to compare like with like</b>"
    )


def _timelines(inp: ReportInputs) -> str:
    devices, cut = _rows_shown(inp)
    width = 1140 if inp.run is None or not inp.run.spans else 570
    sim_svg = svg.timeline_svg(
        _sim_rows(inp, devices),
        inp.sim.iteration_time_s,
        width_px=width,
        title="simulated iteration per device",
        css_id="timeline-sim",
    )
    parts = [f"<div><h3>simulated: {human_time(inp.sim.iteration_time_s)}</h3>{sim_svg}</div>"]
    if inp.run is not None and inp.run.spans:
        rows, length, step = _measured_rows(inp.run, devices)
        measured = svg.timeline_svg(
            rows, length, width_px=width, title="measured step per device", css_id="timeline-run"
        )
        parts.append(f"<div><h3>measured: step {step}, {human_time(length)}</h3>{measured}</div>")
    head = (
        "<p class=muted>Each row is one device: compute in the upper lane, communication in the lower "
        "lane, gaps are idle." + (f" {escape(cut)}." if cut else "") + "</p>"
    )
    timelines = f'<div class="side scroll">{"".join(parts)}</div>'
    legend = page.legend(len(parts) > 1, tensor_parallel=inp.plan.tensor_parallel)
    return f"<h2>Timeline of one iteration</h2>{head}{legend}{timelines}"


def _memory(inp: ReportInputs) -> str:
    devices, cut = _rows_shown(inp)
    rows = []
    for d in devices:
        peak = inp.sim.peak_memory_bytes.get(d, 0)
        cap = inp.sim.memory_capacity_bytes.get(d) or inp.cluster.memory_bytes(d)
        text = (
            f"{human_bytes(peak)} / {human_bytes(cap)} ({100 * peak / max(cap, 1):.0f} %)"
            if d in inp.sim.peak_memory_bytes
            else f"unused / {human_bytes(cap)}"
        )
        rows.append(
            svg.MemoryRow(
                device=d,
                label=d,
                points=tuple(inp.sim.memory_timeline.get(d, ())),
                peak_bytes=peak,
                capacity_bytes=cap,
                text=text,
            )
        )
    missing = (
        ""
        if inp.sim.memory_timeline
        else (
            " The simulator gave no memory timeline for this plan, so the "
            "rows show nothing over time; the figures are the peaks."
        )
    )
    scale = human_bytes(svg.memory_scale_bytes(rows))
    return (
        f"<h2>Memory over the iteration</h2><p class=muted>Memory in use per device, every row on one scale "
        f"(0 to {scale}); a dashed line marks a device's capacity where it lies within that scale. On the "
        f"right: peak / capacity.{escape(missing)}</p>"
        f'<div class="scroll">{svg.memory_svg(rows, inp.sim.iteration_time_s, width_px=1140)}</div>'
    )


def _prediction(inp: ReportInputs) -> str:
    run = inp.run
    if run is None:
        return ""
    other = (
        f"{human_time(run.predicted_iteration_time_s)} ({escape(run.prediction_source)})"
        if run.predicted_iteration_time_s is not None
        else "none"
    )
    lines = "".join(f"<li>{escape(n)}</li>" for n in (*run.provenance(), *run.notes))  # resumed from, re-plans
    steps = "".join(
        f'<tr><td class="num">{x.step}</td><td class="num">{x.loss:.4f}</td>'
        f'<td class="num">{human_time(x.step_time_s)}</td><td>{escape(x.slowest_device)}</td></tr>'
        for x in run.step_lines
    )
    table = (
        (
            f"<table><thead><tr><th>step</th><th>loss</th><th>step time</th><th>slowest rank</th></tr></thead>"
            f"<tbody>{steps}</tbody></table>"
        )
        if steps
        else ""
    )
    other_plan = (run.model, run.strategy) != (inp.plan.model.name, inp.plan.strategy)
    warn = (
        f'<p class="bad">This run is of the {escape(run.strategy)} plan of {escape(run.model)}, not of this '
        f"page's plan: pass the plan the run was made from.</p>"
        if other_plan
        else ""
    )
    return (
        f"<h2>Measured run</h2>{warn}<p>median iteration measured {human_time(run.measured_iteration_time_s)} "
        f"over {run.measured_steps} of {run.options.steps} steps; the run's own prediction: {other}; "
        f"this report's simulation: {human_time(inp.sim.iteration_time_s)}. The run predicts on the cluster as "
        f"its ranks see it (an emulated CPU device is re-measured at one thread per rank), so the two differ when "
        f"the plan was made with another CPU probe or a measured profile.</p><ul>{lines}</ul>{table}"
    )


def build_report(inp: ReportInputs) -> str:
    """The whole page as one string."""
    used = inp.plan.devices()
    finds = "".join(f"<li><b>{escape(f.title)}</b>: {escape(f.text)}</li>" for f in bottleneck.findings(inp.sim, used))
    node_of = inp.cluster.node_of
    devices = [d.name for d in inp.cluster.devices if d.name in set(used)]
    cands = (
        tables.candidates_table(inp.candidates, inp.plan.strategy)
        if inp.candidates
        else "<p class=muted>This file holds only the plan. For the table of every baseline, pass the output of "
        "<code>heterog plan --json</code> or use <code>heterog plan --report FILE</code>.</p>"
    )
    body = (
        _summary(inp)
        + f'<h2>Bottleneck</h2><ul class="find">{finds}</ul>'
        + _timelines(inp)
        + _memory(inp)
        + "<h2>Placement</h2><div class=scroll>"
        + tables.placement_table(inp.plan, devices, {d: d for d in devices}, node_of)
        + "</div><h2>Candidates</h2>"
        + cands
        + _prediction(inp)
        + instruction_section(inp.run)
        + '<p class="muted">Made by <code>heterog report</code>; self-contained: no scripts, fonts or '
        "network requests.</p>"
    )
    return page.page(f"heterog report: {inp.plan.strategy} {inp.plan.model.name} on {inp.cluster.name}", body)
