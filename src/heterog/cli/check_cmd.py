"""`heterog check plan.json --device meta|cpu|cuda`: build every rank's stages for a device and
run their compute without communication, before any cluster is rented (execute/check.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from heterog.cli.output import WIDE_HELP, console, print_json, print_table, set_wide
from heterog.errors import HeterogError
from heterog.fmt import human_bytes, human_time


class CheckFailed(HeterogError):
    """heterog check found a rank that cannot run (its table says which and where)."""


def register(app: typer.Typer) -> None:
    @app.command("check")
    def check_cmd(
        plan: Path = typer.Argument(..., help="A plan file from `heterog plan --out`."),
        device: str = typer.Option(
            "meta",
            "--device",
            help="Where to build and run the ranks' stages: meta "
            "(shapes only: no GPU, no memory), cpu, or cuda[:i] (one GPU, each rank "
            "in turn).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    ) -> None:
        """Check that every rank of a plan can run on a device: its stages built for the device (no
        tensor or graph node pinned elsewhere), and its forward and backward computes run."""
        set_wide(wide)
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog.orchestrate import check, read_plan

        p = read_plan(plan)
        if not as_json:
            console.print(f"checking {p.strategy} plan of {p.model.name} on {device} …")
        result = check(p, device=device)
        if as_json:
            print_json(result.to_dict())
        else:
            print_table(
                f"{p.strategy} plan on {result.target}: {'every rank runs' if result.ok else 'PROBLEMS'}",
                ["rank", "device", "stages", "computes run", "peak mem", "time", "problem"],
                [
                    [
                        str(r.rank),
                        r.device,
                        str(r.stages),
                        f"{r.computes_run}/{r.computes}",
                        human_bytes(r.peak_memory_bytes) if r.peak_memory_bytes is not None else "-",
                        human_time(r.time_s),
                        r.problem or "ok",
                    ]
                    for r in result.ranks
                ],
                optional=("peak mem", "time"),
            )
            for n in result.notes:
                console.print(f"note: {n}")
        if not result.ok:
            bad = next(r for r in result.ranks if not r.ok)
            raise CheckFailed(f"rank {bad.rank} ({bad.device}) cannot run on {result.target}: {bad.problem}")
