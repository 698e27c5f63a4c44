"""`heterog run --elastic`'s options (runs/elastic.py ElasticConfig), declared once here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from heterog.ir.run_request import RunOptions
from heterog.ir.run_result import RunResult

Elastic = Annotated[
    bool,
    typer.Option(
        "--elastic",
        help="Re-plan and go on when a device is lost or the device list changes (needs --checkpoint-dir and "
        "--checkpoint-every; docs/robustness.md).",
    ),
]
Devices = Annotated[
    Path | None,
    typer.Option(
        "--elastic-devices",
        help="--elastic: the devices available now — a file with one name per line, or a cluster file (.yaml) "
        "whose devices are the ones available (it may bring new ones).",
    ),
]
ReplanBudget = Annotated[float, typer.Option("--replan-budget-s", min=0.1, help="--elastic: each re-plan's search.")]


def run(plan: Any, options: RunOptions, params: dict[str, Any], say: Callable[[str], None] | None) -> RunResult:
    """heterog.run_elastic with `heterog run`'s --elastic options (`params`: the command's),
    each launch's files in `launch<k>/` of the run's folder; the supervisor's lines (losses,
    changes, re-plans) as they happen."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.runs.elastic import ElasticConfig, run_elastic

    watched = params.get("elastic_devices")
    cluster = watched is not None and Path(watched).suffix in (".yaml", ".yml")
    config = ElasticConfig(
        devices_file=str(watched) if watched and not cluster else None,
        cluster_file=str(watched) if cluster else None,
        replan_budget_s=params.get("replan_budget_s") or ElasticConfig().replan_budget_s,
    )
    return run_elastic(plan, options, config, say=say)
