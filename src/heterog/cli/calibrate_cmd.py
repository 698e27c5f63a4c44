"""`heterog calibrate`: a device profile → a catalog entry that --device and cluster YAML can name."""

from __future__ import annotations

import json
from pathlib import Path

import typer
import yaml

from heterog.cli.output import console, print_json
from heterog.hardware.catalog import get_gpu
from heterog.jsonio import write_atomic


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        profile: list[Path] = typer.Argument(
            ..., help="A `heterog profile` file, or measurement files (a matmul/copy sweep and/or a steps file)."
        ),
        out: Path = typer.Option(..., "--out", help="Catalog file to write (YAML); point HETEROG_CATALOG at it."),
        name: str | None = typer.Option(None, "--name", help="Name of the new type (default: the base type's)."),
        base: str | None = typer.Option(
            None,
            "--base",
            help="Catalog type whose data-sheet figures the device has (default: the profile's device type).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the entry as JSON."),
    ) -> None:
        """Fit a device type's efficiency and host costs from PROFILE and write a catalog entry.
        Use it with `export HETEROG_CATALOG=FILE` (several files: join with ':'), then
        `--device NAME` or `type: NAME` in a cluster YAML."""
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog.cost.calibrate import calibrate
        from heterog.cost.device_profile import DeviceProfile

        if len(profile) == 1 and _is_device_profile(profile[0]):
            prof = DeviceProfile.load(profile[0])
        else:
            if base is None:
                raise typer.BadParameter("files in the shared-data format do not name the device type; pass --base.")
            prof = DeviceProfile.from_shared_files(profile, base)
        entry = calibrate(prof, name=name, base=base)
        text = (
            "# written by `heterog calibrate`; use with HETEROG_CATALOG="
            + str(out)
            + "\n"
            + yaml.safe_dump({"version": 1, "gpus": [entry]}, sort_keys=False)
        )
        write_atomic(out, text)
        if as_json:
            print_json(entry)
            return
        eff = entry.get("efficiency")
        fitted = (
            f"compute factors {eff['compute']}, memory {eff['memory']}"
            if eff
            else f"fp32 {entry['peak_tflops']['fp32']:.3g} TFLOP/s, "
            f"copy {entry['memory_bandwidth_gbytes_per_s']:.3g} GB/s"
        )
        console.print(
            f"catalog entry {entry['name']!r} written to {out}: {fitted}"
            + (f", host {entry['host']['source']}" if entry.get("host") else "")
        )
        console.print(
            f"use it: export HETEROG_CATALOG={out}, or `catalog: {out}` in a cluster YAML; then "
            f"`type: {entry['name']}` there or `heterog predict ... --device {entry['name']}`"
        )
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog.cost.calibrate import fit_host_speed

        speed = (
            prof.host_speed if prof.host_speed is not None else fit_host_speed(prof, get_gpu(base or prof.device_type))
        )
        if speed is not None:
            console.print(
                f"host speed {speed:.3g} × the reference host: the new type's host costs are this "
                f"machine's (keep host_speed 1 on its nodes); to keep the packaged type instead, write "
                f"`host_speed: {speed:.3g}` on the node in the cluster YAML."
            )


def _is_device_profile(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("kind") == "heterog.DeviceProfile"
    except (OSError, ValueError, AttributeError):
        return False
