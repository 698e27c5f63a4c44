"""`heterog report PLAN [--run RUN.json] --out report.html`: see a plan (and a run) in a browser."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from heterog.cli.output import console, print_json
from heterog.cli.simulate_cmd import inputs_for_plan
from heterog.fmt import human_time
from heterog.ir.plan import Plan
from heterog.jsonio import write_atomic


def write_report(
    plan_path: Path,
    out: Path,
    *,
    run_path: Path | None = None,
    graph: Path | None = None,
    cluster: str | None = None,
    profile: Path | None = None,
) -> dict:
    """Read a plan file (or `plan --json` output) and a run, then write the report."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.report import load_plan_file, load_run

    t0 = time.perf_counter()
    pf = load_plan_file(plan_path)
    run = load_run(run_path) if run_path is not None else None
    return write_report_for(pf, out, run=run, graph=graph, cluster=cluster, profile=profile, t0=t0)


def write_report_for(
    pf,
    out: Path,
    *,
    run=None,
    graph: Path | None = None,
    cluster: str | None = None,
    profile: Any = None,  # as heterog.inputs.plan_inputs takes it
    t0: float | None = None,
) -> dict:
    """Simulate the plan as `heterog simulate` does (same graph, cluster and costs, so the same
    predicted time), build the page and write it atomically. Returns a summary with timings."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.report import ReportInputs, build_report
    from heterog.simulate import simulate

    t0 = time.perf_counter() if t0 is None else t0
    plan, g, c, costs = inputs_for_plan(pf.plan, graph, cluster, profile)
    t1 = time.perf_counter()
    sim = simulate(g, c, plan, costs)
    t2 = time.perf_counter()
    html = build_report(ReportInputs(plan=plan, sim=sim, cluster=c, candidates=pf.candidates, run=run))
    write_atomic(out, html)
    t3 = time.perf_counter()
    return {
        "out": str(out),
        "bytes": len(html.encode()),
        "devices": len(c.devices),
        "iteration_time_s": sim.iteration_time_s,
        "load_s": t1 - t0,
        "simulate_s": t2 - t1,
        "render_s": t3 - t2,
        "total_s": t3 - t0,
    }


def report_from_plan_result(result: dict, out: Path, profile: Any = None) -> dict:
    """`heterog plan --report FILE`: the report of the planner's answer, candidates included."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.report.inputs import PlanFile, candidate_from_dict

    pf = PlanFile(
        plan=Plan.from_dict(result["best"]),
        search_time_s=result.get("search_time_s"),
        candidates=tuple(candidate_from_dict(c, f"candidates[{i}]") for i, c in enumerate(result["candidates"])),
    )
    return write_report_for(pf, out, profile=profile)


def report_command(
    plan_path: Path = typer.Argument(
        ...,
        help="A plan file (`heterog plan --out`) or `heterog plan --json` output (which adds the candidates table).",
    ),
    out: Path = typer.Option(Path("report.html"), "--out", help="Where to write the HTML page."),
    run: Path | None = typer.Option(
        None,
        "--run",
        help="A run's JSON (`heterog run PLAN --out RUN.json`): draw its measured step beside the simulated one.",
    ),
    graph: Path | None = typer.Option(None, "--graph", help="Use this OpGraph file instead of re-capturing."),
    cluster: str | None = typer.Option(None, "--cluster", help="Report on this cluster instead of the plan's."),
    profile: Path | None = typer.Option(
        None, "--profile", help="Measured per-node times, as given to `heterog plan --profile`."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Write one self-contained HTML page: per-device timelines, memory, placement, candidates, bottleneck."""
    summary = write_report(plan_path, out, run_path=run, graph=graph, cluster=cluster, profile=profile)
    if as_json:
        print_json(summary)
    else:
        console.print(
            f"report written to {out} ({summary['bytes'] / 2**10:.0f} KiB, {summary['devices']} devices, "
            f"iteration {human_time(summary['iteration_time_s'])}); open it in a browser"
        )


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
