"""`heterog simulate plan.json`: predict one iteration of a saved plan, with a timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from heterog.cli.output import WIDE_HELP, console, print_json, print_table, set_wide, write_json
from heterog.fmt import human_bytes, human_time
from heterog.inputs import as_plan, plan_inputs
from heterog.ir.opgraph import OpGraph


def load_inputs(plan_path: Path, graph_path: Path | None, cluster_name: str | None, profile: Any = None):
    """The plan, and the graph, cluster and cost model it was made with (heterog/inputs.py,
    as `heterog plan` builds them): the graph from the capture cache (or --graph), the cluster
    the plan records (or --cluster), costs at the plan's precision and optimizer."""
    return inputs_for_plan(as_plan(plan_path), graph_path, cluster_name, profile)


def inputs_for_plan(plan, graph_path: Path | None, cluster_name: str | None, profile: Any = None):
    """load_inputs for a Plan already in memory (`heterog report` reads it from `plan --json`);
    the plan comes back covering the whole graph (lower.schedule.cover_graph), as it runs."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.lower.schedule import cover_graph

    graph = OpGraph.load(graph_path) if graph_path is not None else None
    graph, cluster, costs = plan_inputs(plan, cluster=cluster_name, graph=graph, profile=profile)
    return cover_graph(plan, graph), graph, cluster, costs


def _show(result, plan) -> None:
    rows = []
    for d, peak in result.peak_memory_bytes.items():
        cap = result.memory_capacity_bytes[d]
        busy = result.compute_time_s[d]
        util = busy / result.iteration_time_s if result.iteration_time_s > 0 else 0.0
        rows.append(
            [
                d,
                human_time(busy),
                human_time(result.communication_time_s[d]),
                human_time(result.idle_time_s[d]),
                f"{100 * util:.0f}%",
                human_bytes(peak),
                human_bytes(cap),
                "yes" if peak <= cap else "NO",
            ]
        )
    print_table(
        f"plan {plan.strategy!r}: {len(plan.groups)} groups, {plan.num_microbatches} micro-batch(es), {plan.schedule}",
        ["device", "compute", "comm", "idle", "busy", "peak memory", "memory", "fits"],
        rows,
        optional=("busy", "memory"),
    )
    links = sorted(result.link_bytes.items(), key=lambda kv: -result.link_busy_time_s.get(kv[0], 0.0))[:8]
    if links:
        print_table(
            "busiest links",
            ["link", "bytes", "busy"],
            [[link, human_bytes(b), human_time(result.link_busy_time_s.get(link, 0.0))] for link, b in links],
        )
    line = (
        f"[bold]iteration {human_time(result.iteration_time_s)}[/bold], {result.throughput_samples_per_s:.1f} samples/s"
    )
    if not result.feasible:
        line += (
            f"; [red]does not fit: {result.overflow_device} needs "
            f"{human_bytes(result.overflow_bytes)} more than it has[/red]"
        )
    console.print(line)


def simulate_command(
    plan_path: Path = typer.Argument(..., help="A plan file written by `heterog plan --out`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    trace: Path | None = typer.Option(None, "--trace", help="Write a Chrome trace (open in Perfetto)."),
    graph: Path | None = typer.Option(None, "--graph", help="Use this OpGraph file instead of re-capturing."),
    cluster: str | None = typer.Option(None, "--cluster", help="Simulate on this cluster instead of the plan's."),
    priorities: str | None = typer.Option(
        None, "--priorities", help="Recompute execution priorities: upward or heteroG."
    ),
    profile: Path | None = typer.Option(
        None,
        "--profile",
        help="Measured per-node times, as given to `heterog plan --profile` (the same prediction needs the same file).",
    ),
) -> None:
    """Simulate one training iteration of PLAN: time, per-device busy/idle time, memory, links."""
    set_wide(wide)
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.simulate import assign_priorities, simulate

    plan, g, c, costs = load_inputs(plan_path, graph, cluster, profile)
    if priorities is not None:
        plan = assign_priorities(g, c, plan, costs, priorities)
    result = simulate(g, c, plan, costs)
    if trace is not None:
        write_json(str(trace), result.to_chrome_trace())
    if as_json:
        out: dict[str, Any] = result.to_dict()
        if trace is not None:
            out["trace"] = str(trace)
        print_json(out)
    else:
        _show(result, plan)
        if trace is not None:
            console.print(f"trace written to {trace} (open it at https://ui.perfetto.dev)")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_command)
