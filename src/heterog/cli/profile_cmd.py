"""`heterog profile`: measure this machine's device into a DeviceProfile file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from heterog.cli.output import console, parse_model_args, print_json, print_table
from heterog.fmt import human_time
from heterog.hardware.catalog import precision_help
from heterog.ir.plan import PRECISIONS


def profile_cmd(
    out: Path = typer.Option(..., "--out", help="Where to write the profile (JSON)."),
    model: str | None = typer.Option(None, "--model", help="Also measure this model's steps and per-node times."),
    model_arg: list[str] | None = typer.Option(None, "--model-arg", help="Model argument key=value (repeatable)."),
    batch_sizes: str = typer.Option("1,4", "--batch-sizes", help="Comma-separated batch sizes for --model."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1),
    precision: str = typer.Option("fp32", "--precision", help="Precision of --model's steps: " + precision_help()),
    optimizer: str = typer.Option("sgd", "--optimizer", help="sgd | adamw (steps of --model)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA if visible, else CPU) | cpu | cuda | cuda:N."),
    quick: bool = typer.Option(False, "--quick", help="Fewer GEMM sizes and a smaller copy."),
    no_comm: bool = typer.Option(False, "--no-comm", help="Skip the two-rank all-reduce / p2p measurement."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
) -> None:
    """Measure GEMM throughput, copy bandwidth, host time per op, two-rank all-reduce and
    p2p bandwidth, and (with --model) whole steps and per-node times; `heterog calibrate`
    turns the file into a catalog entry, `predict/plan --profile` use its node times."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.profile.run import profile_device

    if precision not in PRECISIONS:
        raise typer.BadParameter(f"--precision must be one of {', '.join(PRECISIONS)}, found {precision!r}.")
    try:
        sizes = tuple(int(b) for b in batch_sizes.split(",") if b.strip())
    except ValueError:
        raise typer.BadParameter(f"--batch-sizes must be comma-separated integers, found {batch_sizes!r}.") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter("--batch-sizes needs at least one batch size ≥ 1.")
    say = (lambda m: None) if as_json else (lambda m: console.print(f"[dim]{m}[/dim]"))
    prof = profile_device(
        model=model,
        model_args=parse_model_args(model_arg),
        batch_sizes=sizes,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        device=device,
        quick=quick,
        comm=not no_comm,
        say=say,
    )
    prof.save(out)
    if as_json:
        print_json(prof.to_dict())
        return
    _print_profile(prof, out)


def _print_profile(prof: Any, out: Path) -> None:
    """The measured rates as a table, and what to write in the cluster YAML."""
    rows = [(f"GEMM {g['dtype']} n={g['n']}", f"{2 * g['n'] ** 3 / g['time_s'] / 1e12:.2f} TFLOP/s") for g in prof.gemm]
    copy_bytes_per_s = prof.copy_bandwidth_bytes_per_s() if prof.copy else None
    if copy_bytes_per_s is not None:
        rows.append(("copy", f"{copy_bytes_per_s / 1e9:.1f} GB/s"))
    rows += [(f"host {k}", human_time(v)) for k, v in (prof.host or {}).items()]
    comm = prof.comm or {}
    for r in comm.get("rows", []):
        rows.append(
            (
                f"{comm['backend']} all-reduce {r['bytes'] / 2**20:.0f} MiB",
                f"{r['bytes'] / r['allreduce_s'] / 1e9:.2f} GB/s",
            )
        )
        rows.append(
            (
                f"{comm['backend']} p2p {r['bytes'] / 2**20:.0f} MiB",
                f"{r['bytes'] / r['p2p_s'] / 1e9:.2f} GB/s",
            )
        )
    rows += [(f"step {s['model']} batch {s['batch_size']}", human_time(s["time_s"])) for s in prof.steps]
    if prof.host_speed is not None:
        rows.append(("host speed", f"{prof.host_speed:.3g} × the reference host"))
    print_table(f"profile of {prof.device['name']} ({prof.device_type})", ["", "measured"], rows)
    console.print(f"profile written to {out}")
    if prof.host_speed is not None:
        console.print(f"in the cluster YAML, on this machine's node: host_speed: {prof.host_speed:.3g}")
    elif prof.device_type != "cpu":
        console.print(
            "host speed not measured: add --model (e.g. --model resnet50 --batch-sizes 1,2) to measure host-bound steps"
        )


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
