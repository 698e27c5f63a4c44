"""`heterog lower plan.json`: the plan's Program — what each device will execute, in order."""

from __future__ import annotations

from pathlib import Path

import typer

from heterog.cli.output import WIDE_HELP, print_json, print_table, set_wide
from heterog.fmt import human_bytes

KINDS = ("compute", "send", "recv", "collective", "optimizer")


def lower_command(
    plan_path: Path = typer.Argument(..., help="A plan file written by `heterog plan --out`."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-device summary as JSON."),
    out: Path | None = typer.Option(None, "--out", help="Write the Program (versioned JSON) here."),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
) -> None:
    """Lower PLAN to its Program: per device, the instructions it runs (compute, send, receive,
    collective, optimizer step), the bytes it sends and receives, and the peak memory implied."""
    set_wide(wide)
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.orchestrate import lower

    program = lower(plan_path)
    if out is not None:
        program.save(out)
    summary = program.summary()
    if as_json:
        print_json(
            {
                "devices": summary,
                "blocks": len(program.blocks),
                "microbatch_sizes": list(program.microbatch_sizes),
                **({"program": str(out)} if out is not None else {}),
            }
        )
        return
    rows = [
        [
            d,
            *(str(s["instructions"].get(k, 0)) for k in KINDS),
            human_bytes(s["sent_bytes"]),
            human_bytes(s["received_bytes"]),
            human_bytes(s["peak_memory_bytes"]),
        ]
        for d, s in summary.items()
    ]
    print_table(
        f"program: {len(program.blocks)} blocks, micro-batches {list(program.microbatch_sizes)}",
        ["device", "compute", "send", "recv", "coll", "opt", "sent", "received", "peak memory"],
        rows,
    )
    if out is not None:
        typer.echo(f"program written to {out}")


def register(app: typer.Typer) -> None:
    app.command("lower")(lower_command)
