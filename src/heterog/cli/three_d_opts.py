"""`heterog plan --strategy 3d`: the options of the Megatron/DeepSpeed-style plan and its writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from heterog.cli.output import console, print_json
from heterog.fmt import human_bytes, human_time

STRATEGY = "3d"  # search/three_d.py STRATEGY (not imported: `heterog --help` starts without numpy)
GRID = "megatron-3d"  # the best uniform tp × pp × dp plan, scored by the simulator

STRATEGY_OPTION = typer.Option(
    None,
    "--strategy",
    help="Write this candidate's plan to --out instead of the best (a name from the candidates table, e.g. "
    "even-dp-allreduce); or 3d: write the Megatron-style plan of --tp/--pp/--dp without a search; or "
    "megatron-3d: the best uniform tp × pp × dp plan within --budget-s.",
)
TP_OPTION = typer.Option(None, "--tp", min=1, help="--strategy 3d: tensor-parallel degree (1, 2, 4 or 8).")
PP_OPTION = typer.Option(None, "--pp", min=1, help="--strategy 3d: pipeline stages.")
DP_OPTION = typer.Option(None, "--dp", min=1, help="--strategy 3d: data-parallel replicas of each stage.")
STAGE_LAYERS_OPTION = typer.Option(
    None, "--stage-layers", help="--strategy 3d: blocks per stage, e.g. 7,9,9,9 (default: an even split)."
)
MICROBATCHES_OPTION = typer.Option(1, "--microbatches", min=1, help="--strategy 3d: micro-batches per iteration.")
SCHEDULE_OPTION = typer.Option("1f1b", "--schedule", help="--strategy 3d: pipeline schedule, gpipe or 1f1b.")
ZERO_OPTION = typer.Option(0, "--zero", min=0, max=3, help="--strategy 3d: ZeRO stage across the dp replicas.")
TENSOR_PARALLEL_OPTION = typer.Option(
    True,
    "--tensor-parallel/--no-tensor-parallel",
    help="Let the search split groups by tensor parallelism (the megatron-3d candidate too). `heterog run` "
    "cannot run such plans yet: plan with --no-tensor-parallel for a plan to run.",
)
DEVICES_OPTION = typer.Option(
    None, "--devices", help="--strategy 3d: the tp·pp·dp devices in rank order (default: Megatron's order)."
)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(
            f"give comma-separated whole numbers, e.g. 7,9,9,9; found {text!r}.", param_hint=flag
        ) from None


def check_3d_options(strategy: str | None, shape: dict[str, Any]) -> None:
    """The 3d options belong to --strategy 3d, which needs --tp, --pp and --dp."""
    used = [f"--{k.replace('_', '-')}" for k, v in shape.items() if v is not None]
    if strategy != STRATEGY and used:
        raise typer.BadParameter(
            f"{', '.join(used)} describe a Megatron-style plan; add --strategy 3d (with --tp, --pp and --dp)."
        )
    if strategy == STRATEGY:
        missing = [f"--{k}" for k in ("tp", "pp", "dp") if shape.get(k) is None]
        if missing:
            raise typer.BadParameter(f"--strategy 3d needs {', '.join(missing)} (e.g. --tp 2 --pp 4 --dp 2).")


def write_fixed(
    strategy: str, inputs: dict[str, Any], shape: dict[str, Any], *, budget_s: float, out: Path | None, as_json: bool
) -> None:
    """--strategy 3d (the plan `shape` gives) or megatron-3d (the best uniform one)."""
    if strategy == GRID:
        write_grid(inputs, budget_s=budget_s, out=out, as_json=as_json)
    else:
        write_3d(inputs, shape=shape, out=out, as_json=as_json)


def write_grid(inputs: dict[str, Any], *, budget_s: float, out: Path | None, as_json: bool) -> None:
    """The megatron-3d baseline (heterog.plan_megatron_3d), written to `out` and shown."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.plan_module import plan_megatron_3d

    _show(plan_megatron_3d(inputs.pop("model"), budget_s=budget_s, **inputs), out, as_json)


def _show(plan, out: Path | None, as_json: bool) -> None:
    if out is not None:
        plan.save(out)
    if as_json:
        print_json(plan.to_dict())
        return
    peak = max(plan.predicted_peak_memory_bytes.values())
    console.print(
        f"[bold]{plan.strategy} plan[/bold] of {plan.model.name}: "
        f"{human_time(plan.predicted_iteration_time_s or 0.0)} per iteration, peak memory {human_bytes(peak)}"
    )
    for note in plan.notes:
        console.print(f"  {note}")
    if out is not None:
        console.print(f"plan written to {out}")


def write_3d(inputs: dict[str, Any], *, shape: dict[str, Any], out: Path | None, as_json: bool) -> None:
    """Build the 3d plan (heterog.plan_3d) of `shape` (--tp … --zero), write it to `out` and show it."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.plan_module import plan_3d

    layers, devices = shape["stage_layers"], shape["devices"]
    options = {
        **shape,
        "stage_layers": _ints(layers, "--stage-layers") if layers else None,
        "devices": [d.strip() for d in devices.split(",")] if devices else None,
    }
    _show(plan_3d(inputs.pop("model"), **inputs, **options), out, as_json)
