"""The report stage (plan + SimResult → HTML), the per-step log and the measured trace.

The SimResults here come from the real simulator on synthetic graphs (simulate_support), so the
report is checked against what the simulator says, not against hand-made numbers.
"""

from __future__ import annotations

import json
import re
import time
from html.parser import HTMLParser

import pytest
from simulate_support import TableCosts, chain_graph, cluster

import heterog.simulate as sim_pkg
from heterog.execute.steplog import STEPS_FILE, StepLog, StepRecord, merge, read_records, read_run
from heterog.execute.trace import RankSpans, SpanCategory, StepRecorder, chrome_trace
from heterog.hardware.spec import load_cluster
from heterog.ir.kinds import InstructionKind, Phase
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import RunOptions
from heterog.ir.run_result import InstructionTiming, Repetition, RunResult, Span, StepLine
from heterog.report import ReportInputs, build_report, tables
from heterog.report.inputs import Candidate, load_plan_file, load_run
from heterog.report.svg import Bar, merge_intervals
from heterog.report.tables import segments


class _Rows(HTMLParser):
    """Collects the data-device of every timeline / memory row and every external reference."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.refs: list[str] = []
        self._svg: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self._svg = a.get("id")
        if tag == "g" and "data-device" in a:
            self.rows.setdefault(self._svg or "", []).append(a["data-device"])
        for k in ("src", "href"):
            if k in a:
                self.refs.append(a[k])
        if tag == "link" or tag == "script":
            self.refs.append(tag)


def _plan_on(devices: list[str], n_nodes: int, *, split: int = 2) -> Plan:
    """The first half of the chain data-parallel over every device with uneven shares, the
    rest model-parallel on the first device."""
    w = [1.0 + (i % 3) for i in range(len(devices))]
    shares = [x / sum(w) for x in w]
    shares[-1] = 1.0 - sum(shares[:-1])
    half = n_nodes // split
    dp = Group(
        name="g0",
        nodes=tuple(f"l{i}" for i in range(half)),
        sync="ring",
        replicas=tuple(Replica(device=d, share=s) for d, s in zip(devices, shares)),
    )
    mp = Group(
        name="g1", nodes=tuple(f"l{i}" for i in range(half, n_nodes)), replicas=(Replica(device=devices[0], share=1.0),)
    )
    return Plan(strategy="test", model=ModelSpec(name="chain", batch_size=64), groups=(dp, mp), num_microbatches=2)


def _report(clu, n_nodes: int = 12, **kw) -> tuple[str, object, Plan]:
    g = chain_graph(n_nodes, batch_size=64)
    plan = _plan_on([d.name for d in clu.devices], n_nodes)
    result = sim_pkg.simulate(g, clu, plan, TableCosts(g, clu))
    return build_report(ReportInputs(plan=plan, sim=result, cluster=clu, **kw)), result, plan


def test_report_has_a_timeline_and_memory_row_per_device_and_no_external_reference():
    clu = cluster([[1e12, 1e12], [2e12, 2e12], [5e11, 5e11, 5e11, 5e11]])
    html, result, _ = _report(clu)
    p = _Rows()
    p.feed(html)
    names = [d.name for d in clu.devices]
    assert p.rows["timeline-sim"] == names
    assert p.rows["memory"] == names
    assert p.refs == []  # nothing to fetch: no src, href, link, script
    assert "default-src 'none'" in html  # and the page forbids fetching anything
    assert "prefers-color-scheme:dark" in html
    # the headline is the simulator's time, as `heterog simulate` prints it
    from heterog.fmt import human_time

    assert human_time(result.iteration_time_s) in html


def test_timeline_bars_cover_the_simulated_compute_time():
    """The drawn compute bars of each device add up (within merging) to the simulator's
    compute time of that device."""
    clu = cluster([[1e12, 1e12], [2e12]])
    html, result, _ = _report(clu)
    T = result.iteration_time_s
    svg_part = html[html.index('id="timeline-sim"') : html.index("</svg>", html.index('id="timeline-sim"'))]
    for d in result.compute_time_s:
        row = svg_part[svg_part.index(f'data-device="{d}"') :]
        row = row[: row.index("</g>")]
        plot_px = 1140 - 150 - 28
        widths = [float(w) for w in re.findall(r'class="k-(?:forward|backward|optimizer)"[^>]*width="([\d.]+)"', row)]
        drawn_s = sum(widths) * T / plot_px
        assert drawn_s == pytest.approx(result.compute_time_s[d], rel=0.05, abs=T * 0.01), d


def test_merge_intervals_joins_only_same_kind_within_tolerance():
    bars = [
        Bar(kind="forward", start_s=0, end_s=1),
        Bar(kind="forward", start_s=1.05, end_s=2),
        Bar(kind="backward", start_s=2, end_s=3),
        Bar(kind="forward", start_s=3, end_s=4),
    ]
    out = sorted(merge_intervals(bars, 0.1), key=lambda b: b.start_s)
    assert [(b.kind, b.start_s, b.end_s) for b in out] == [("forward", 0, 2), ("backward", 2, 3), ("forward", 3, 4)]


def test_placement_segments_merge_consecutive_equal_groups():
    reps = (Replica(device="a", share=0.5), Replica(device="b", share=0.5))
    gs = (
        Group(name="g0", nodes=("x",), replicas=reps, sync="ring"),
        Group(name="g1", nodes=("y", "z"), replicas=reps, sync="ring"),
        Group(name="g2", nodes=("w",), replicas=(Replica(device="a", share=1.0),)),
    )
    plan = Plan(strategy="t", model=ModelSpec(name="m", batch_size=4), groups=gs)
    s = segments(plan)
    assert [(x.first, x.last, x.nodes, x.sync) for x in s] == [(0, 1, 3, "ring"), (2, 2, 1, "none")]


def test_candidates_table_speedup_is_relative_to_even_dp():
    clu = cluster([[1e12, 1e12]])
    cands = (
        Candidate(
            strategy="even-dp-allreduce",
            iteration_time_s=0.4,
            feasible=True,
            peak_memory_bytes={"n0/d0": 2**30},
            devices_used=2,
            num_microbatches=1,
        ),
        Candidate(
            strategy="test",
            iteration_time_s=0.1,
            feasible=True,
            peak_memory_bytes={},
            devices_used=2,
            num_microbatches=2,
        ),
        Candidate(
            strategy="single-device",
            iteration_time_s=None,
            feasible=False,
            peak_memory_bytes={"n0/d0": 2**34},
            devices_used=1,
            num_microbatches=1,
        ),
    )
    html, _, _ = _report(clu, candidates=cands)
    table = html[html.index('<table class="candidates"') :]
    table = table[: table.index("</table>")]
    assert "4.00×" in table and "1.00×" in table and "no (memory)" in table
    assert '<tr class="chosen"><th>test</th>' in table


def test_report_for_64_devices_is_small_and_fast():
    """mixed-64's real topology, a 400-node chain: under 2 MB and well under 5 s to render."""
    clu = load_cluster("mixed-64")
    g = chain_graph(400, batch_size=256)
    plan = _plan_on([d.name for d in clu.devices], 400, split=1)
    plan = Plan(
        strategy="test", model=ModelSpec(name="chain", batch_size=256), groups=plan.groups[:1], num_microbatches=4
    )
    result = sim_pkg.simulate(g, clu, plan, TableCosts(g, clu))
    t0 = time.perf_counter()
    html = build_report(ReportInputs(plan=plan, sim=result, cluster=clu))
    render_s = time.perf_counter() - t0
    assert len(html.encode()) < 2 * 2**20
    assert render_s < 5.0
    p = _Rows()
    p.feed(html)
    assert len(p.rows["timeline-sim"]) == 64


def test_report_aggregates_placement_by_node_above_64_devices():
    clu = cluster([[1e12] * 8 for _ in range(12)])  # 96 devices on 12 nodes
    html, _, _ = _report(clu)
    table = html[
        html.index('<table class="placement"') : html.index("</table>", html.index('<table class="placement"'))
    ]
    assert "12 nodes" in table
    assert table.count('<th class="dev') == 12


def test_load_plan_file_reads_plan_and_planner_json(tmp_path):
    clu = cluster([[1e12, 1e12]])
    plan = _plan_on([d.name for d in clu.devices], 4)
    plan.save(tmp_path / "p.json")
    assert load_plan_file(tmp_path / "p.json").plan == plan
    doc = {
        "best": plan.to_dict(),
        "search_time_s": 1.0,
        "candidates": [
            {
                "strategy": "test",
                "iteration_time_s": 0.1,
                "feasible": True,
                "peak_memory_bytes": {"n0/d0": 5},
                "devices_used": 2,
                "num_microbatches": 2,
            }
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(doc))
    pf = load_plan_file(tmp_path / "r.json")
    assert pf.plan == plan and pf.candidates[0].max_peak_memory_bytes == 5
    (tmp_path / "x.json").write_text("{}")
    from heterog.errors import ArtifactError

    with pytest.raises(ArtifactError, match="heterog plan"):
        load_plan_file(tmp_path / "x.json")
    with pytest.raises(ArtifactError, match="heterog run"):
        load_run(tmp_path / "x.json")


def _measured_run(names: list[str]) -> RunResult:
    """A run of two devices: three steps of spans (the last one the median), and one forward
    per device joined with its prediction."""
    spans = []
    for step, base, length in ((0, 100.0, 0.4), (1, 100.5, 0.3), (2, 101.0, 0.35)):
        for rank in range(len(names)):
            spans += [
                Span(
                    name=f"step {step}",
                    category=SpanCategory.STEP,
                    rank=rank,
                    step=step,
                    start_s=base,
                    end_s=base + length,
                ),
                Span(
                    name="fw",
                    category=SpanCategory.FORWARD,
                    rank=rank,
                    step=step,
                    start_s=base,
                    end_s=base + 0.2,
                    index=0,
                    op=7,
                ),
                Span(
                    name="sync",
                    category=SpanCategory.COLLECTIVE,
                    rank=rank,
                    step=step,
                    start_s=base + 0.2,
                    end_s=base + 0.3,
                ),
            ]
    timing = [
        InstructionTiming(
            id=f"7@{d}",
            device=d,
            rank=r,
            index=0,
            op=7,
            kind=InstructionKind.COMPUTE,
            phase=Phase.FORWARD,
            name="g F mb0",
            predicted_start_s=0.0,
            predicted_end_s=0.05 * (1 + r),
            measured_start_s=0.0,
            measured_end_s=0.2,
            measured_s=0.2,
        )
        for r, d in enumerate(names)
    ]
    return RunResult(
        strategy="test",
        model="m",
        cluster="c",
        devices=tuple(names),
        options=RunOptions(steps=3),
        repetitions=(
            Repetition(measured_iteration_time_s=0.35, measured_steps=2, losses=(2.3, 2.2, 2.1), per_rank=()),
        ),
        predicted_iteration_time_s=0.25,
        prediction_source="simulator",
        spans=tuple(spans),
        shown_step=2,
        step_lines=(StepLine(step=0, loss=2.3, step_time_s=0.4, slowest_rank=1, slowest_device=names[1]),),
        instructions=tuple(timing),
    )


def test_measured_run_is_drawn_beside_the_simulated_one_instruction_by_instruction(tmp_path):
    clu = cluster([[1e12, 1e12]])
    names = [d.name for d in clu.devices]
    _measured_run(names).save(tmp_path / "run.json")
    html, _, _ = _report(clu, run=load_run(tmp_path / "run.json"))
    p = _Rows()
    p.feed(html)
    assert p.rows["timeline-run"] == names
    assert "measured: step 2, 350.00 ms" in html  # the median step, 2, not the slow first
    # the same instructions, simulated above measured, each bar naming its instruction
    assert p.rows["timeline-pairs"] == [names[0], names[0], names[1], names[1]]
    assert f"<title>7@{names[1]}: g F mb0</title>" in html
    # per device and kind, the larger miss first: a's forward (predicted 50 ms, 150 ms short)
    # before b's (predicted 100 ms)
    table = html[html.index("<table id=by-kind>") : html.index("</table>", html.index("<table id=by-kind>"))]
    assert table.index(names[0]) < table.index(names[1]) and "+150.00 ms" in table
    assert "not of this page's plan" in html  # the run names another plan (strategy 'test' of 'm')


# -- per-step log and measured trace ------------------------------------------------------------


def test_step_log_merges_ranks_and_skips_a_half_written_line(tmp_path):
    for rank, times in ((0, (0.10, 0.20)), (1, (0.30, 0.05))):
        log = StepLog(tmp_path / STEPS_FILE.format(rank=rank))
        for step, t in enumerate(times):
            log.append(StepRecord(step=step, rank=rank, device=f"d{rank}", loss=1.0 + rank, step_time_s=t))
    with open(tmp_path / STEPS_FILE.format(rank=1), "a") as f:
        f.write('{"step": 2, "ra')  # rank 1 is writing step 2
    assert len(read_records(tmp_path / STEPS_FILE.format(rank=1))) == 2
    lines = read_run(tmp_path, 2)
    assert [(x.step, x.loss, x.step_time_s, x.slowest_rank, x.slowest_device) for x in lines] == [
        (0, 3.0, 0.30, 1, "d1"),
        (1, 3.0, 0.20, 0, "d0"),
    ]
    # a step only one rank has finished is not a line yet
    only0 = [StepRecord(step=5, rank=0, device="d0", loss=0.0, step_time_s=1.0)]
    assert merge(only0, 2) == []


def test_step_recorder_spans_and_chrome_trace():
    rec = StepRecorder(rank=1, device="gpu1")
    rec.step = 3
    with rec.span("step 3", SpanCategory.STEP):
        with rec.span("fwd", "compute"):
            time.sleep(0.01)
        with pytest.raises(RuntimeError):
            with rec.span("sync", SpanCategory.SYNC):
                raise RuntimeError("peer died")
    assert [s.name for s in rec.spans] == ["fwd", "sync", "step 3"]
    fwd, sync, step = rec.spans
    assert fwd.end_s - fwd.start_s >= 0.01 and step.start_s <= fwd.start_s and step.end_s >= sync.end_s
    assert abs(step.start_s - time.time()) < 60  # epoch time: ranks share an axis
    back = RankSpans.from_dict(json.loads(json.dumps(rec.to_dict())))
    other = RankSpans(rank=0, device="gpu0", spans=())
    trace = chrome_trace([back, other])
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {2}
    assert {(e["name"], e["tid"]) for e in xs} == {("fwd", 1), ("sync", 2), ("step 3", 3)}
    assert min(e["ts"] for e in xs) == 0.0
    assert next(e for e in xs if e["name"] == "fwd")["dur"] >= 1e4  # microseconds
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["gpu0 (rank 0, measured)", "gpu1 (rank 1, measured)"]


def test_report_command_writes_the_page_with_the_simulate_command_time(tmp_path):
    """`heterog report` and `heterog simulate` on the same files give the same iteration time."""
    import dataclasses

    from typer.testing import CliRunner

    from heterog.cli.main import app
    from heterog.hardware.spec import cluster_to_dict

    g = chain_graph(6, flops=5e9, param_bytes=8_000_000, edge_bytes=4e5, batch_size=32)
    clu = load_cluster("paper-8gpu")
    plan = _plan_on(["v100/gpu0", "v100/gpu1", "gtx0/gpu0", "p100/gpu1"], 6)
    plan = dataclasses.replace(
        plan,
        model=ModelSpec(name="chain", batch_size=32),
        cluster=cluster_to_dict(clu),
        cluster_fingerprint=clu.fingerprint(),
        graph_fingerprint=g.fingerprint(),
    )
    g.save(tmp_path / "g.json")
    plan.save(tmp_path / "p.json")
    out = tmp_path / "r.html"
    res = CliRunner().invoke(
        app, ["report", str(tmp_path / "p.json"), "--graph", str(tmp_path / "g.json"), "--out", str(out), "--json"]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    sim = CliRunner().invoke(app, ["simulate", str(tmp_path / "p.json"), "--graph", str(tmp_path / "g.json"), "--json"])
    assert summary["iteration_time_s"] == json.loads(sim.stdout)["iteration_time_s"]
    assert summary["bytes"] == len(out.read_bytes()) and summary["devices"] == 8
    p = _Rows()
    p.feed(out.read_text())
    assert p.rows["timeline-sim"] == [d.name for d in clu.devices]
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "g.json"), "--out", str(out)])
    assert bad.exit_code != 0 and "heterog plan" in str(bad.exception)


def test_report_says_when_the_plan_recorded_another_prediction():
    import dataclasses

    clu = cluster([[1e12, 1e12]])
    g = chain_graph(6, batch_size=64)
    plan = _plan_on([d.name for d in clu.devices], 6)
    result = sim_pkg.simulate(g, clu, plan, TableCosts(g, clu))
    same = build_report(ReportInputs(plan=plan.with_prediction(result.iteration_time_s, {}), sim=result, cluster=clu))
    assert "The plan file records" not in same
    other = dataclasses.replace(plan, predicted_iteration_time_s=2 * result.iteration_time_s)
    html = build_report(ReportInputs(plan=other, sim=result, cluster=clu))
    assert "The plan file records" in html and "re-plan" in html


def test_above_128_devices_the_timeline_has_a_row_per_node():
    clu = cluster([[1e12] * 8 for _ in range(20)])  # 160 devices on 20 nodes
    html, result, _ = _report(clu)
    p = _Rows()
    p.feed(html)
    rows = p.rows["timeline-sim"]
    assert len(rows) == 20 and len({clu.node_of[d] for d in rows}) == 20
    for d in rows:  # each the least idle of its node
        node = [x.name for x in clu.devices if clu.node_of[x.name] == clu.node_of[d]]
        assert result.idle_time_s[d] == min(result.idle_time_s[x] for x in node)
    assert "one row per node (20 nodes, 160 devices)" in html


def test_candidates_table_shows_each_priced_candidates_cost():
    cost = {"usd_per_hour": 2.0, "usd_per_step": 2.0 * 0.1 / 3600, "usd_per_million_samples": 0.87}
    row = dict(feasible=True, peak_memory_bytes={}, devices_used=1, num_microbatches=1)
    cands = (
        Candidate(strategy="test", iteration_time_s=0.1, cost=cost, **row),
        Candidate(strategy="unpriced", iteration_time_s=0.2, **row),
    )
    html = tables.candidates_table(cands, "test")
    assert "<th>$ per million samples</th>" in html and "$2.00" in html and "$0.87" in html
    assert html.count('<td class="num">—</td>') == 3  # the unpriced candidate's three cost cells
    assert tables.cost_kpis(cost) == [("cost (planned)", "$2.00 per hour, $0.87 per million samples")]
    assert "$ per" not in tables.candidates_table(cands[1:], "unpriced")
