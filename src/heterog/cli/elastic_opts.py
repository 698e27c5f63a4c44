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
    typer.Option("--elastic-devices", help="--elastic: a file listing the devices available now, one per line."),
]
ClusterFile = Annotated[
    Path | None,
    typer.Option("--elastic-cluster", help="--elastic: a cluster file whose devices are the ones available now."),
]
ReplanBudget = Annotated[float, typer.Option("--replan-budget-s", min=0.1, help="--elastic: each re-plan's search.")]


def run(
    plan: Any,
    options: RunOptions,
    devices: Path | None,
    cluster: Path | None,
    budget_s: float,
    say: Callable[[str], None] | None,
) -> RunResult:
    """heterog.run_elastic, each launch's files in `launch<k>/` of the run's folder; the
    supervisor's lines (losses, changes, re-plans) as they happen."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.runs.elastic import ElasticConfig, run_elastic

    config = ElasticConfig(
        devices_file=str(devices) if devices else None,
        cluster_file=str(cluster) if cluster else None,
        replan_budget_s=budget_s,
    )
    return run_elastic(plan, options, config, say=say)
