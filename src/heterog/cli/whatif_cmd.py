"""`heterog whatif`: the predicted iteration with k devices of a type added or removed, by
heterog's plan and by even data parallelism (heterog/cluster_change.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from heterog.cli.output import console, parse_model_args, print_json, print_table, set_wide, write_json
from heterog.fmt import human_time, human_usd
from heterog.hardware.catalog import precision_help

NOISE = 0.02  # changes within 2 % are not called slower or faster


def _cost(cost: dict[str, float]) -> list[str]:
    """The plan's price per hour and per million samples; '-' where a used device has no price."""
    if not cost:
        return ["-", "-"]
    return [human_usd(cost["usd_per_hour"]), human_usd(cost["usd_per_million_samples"])]


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def register(app: typer.Typer) -> None:
    @app.command("whatif")
    def whatif_cmd(
        model: str = typer.Option(..., "--model", help="Zoo model name or path/file.py:factory."),
        model_arg: list[str] | None = typer.Option(None, "--model-arg", help="Model argument key=value (repeatable)."),
        batch_size: int = typer.Option(..., "--batch-size", min=1, help="Global batch size of one iteration."),
        seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Sequence length (language models)."),
        cluster: str = typer.Option(..., "--cluster", help="The cluster as it is: YAML file or built-in name."),
        add: str | None = typer.Option(None, "--add", help="Devices to add, TYPE:COUNT,… (e.g. T4:4,V100-16GB:2)."),
        remove: str | None = typer.Option(None, "--remove", help="Devices to remove, TYPE:COUNT,…"),
        together: bool = typer.Option(False, "--together", help="Weigh all changes at once, not one by one."),
        pool: Path | None = typer.Option(
            None,
            "--pool",
            help="A cluster YAML whose nodes the added devices come from (default: a new node "
            "connected as the cluster's best-connected node).",
        ),
        nic_gbps: float | None = typer.Option(None, "--nic-gbps", min=0.001, help="NIC speed of an added node."),
        precision: str = typer.Option("fp32", "--precision", help=precision_help()),
        optimizer: str = typer.Option("sgd", "--optimizer", help="sgd or adamw."),
        budget_s: float = typer.Option(5.0, "--budget-s", min=0.1, help="Search budget of each plan, seconds."),
        seed: int = typer.Option(0, "--seed", help="Random seed of the searches."),
        max_iters: int | None = typer.Option(None, "--max-iters", min=1, help="Cap each search at this many moves."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
        out: Path | None = typer.Option(None, "--out", help="Also write the JSON document here."),
        wide: bool = typer.Option(False, "--wide", help="Print every table column."),
    ) -> None:
        """Would more (or fewer) devices help? Each change planned by heterog, beside even data
        parallelism on all the devices, both against the cluster as it is."""
        set_wide(wide)
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog.cluster_change import whatif

        if not as_json:
            console.print(f"planning {model} on {cluster} and each change ({budget_s:g} s of search each) …")
        result = whatif(
            model,
            batch_size=batch_size,
            cluster=cluster,
            add=add,
            remove=remove,
            together=together,
            pool=pool,
            nic_gbps=nic_gbps,
            model_args=parse_model_args(model_arg) or None,
            seq_len=seq_len,
            precision=precision,
            optimizer=optimizer,
            budget_s=budget_s,
            seed=seed,
            max_iters=max_iters,
        )
        doc = result.to_dict()
        if out is not None:
            write_json(str(out), doc)
        if as_json:
            print_json(doc)
            return
        _show(result, model, batch_size)


def _show(result, model: str, batch_size: int) -> None:
    rows = [
        [
            s.label,
            str(s.devices),
            s.plan_strategy,
            str(s.plan_devices_used),
            human_time(s.plan_time_s) if s.plan_time_s is not None else "no fit",
            _times(result.speedup(s, "plan")),
            human_time(s.even_dp_time_s) if s.even_dp_time_s is not None else "no fit",
            _times(result.speedup(s, "even_dp")),
            *_cost(s.plan_cost),
        ]
        for s in (result.base, *result.scenarios)
    ]
    print_table(
        f"what if: {model} (batch {batch_size}) on {result.cluster}; x: speed-up over the cluster as it is",
        ["change", "devices", "heterog's plan", "uses", "iteration", "x", "even DP", "x ", "$/hour", "$/M samples"],
        rows,
        optional=("$/hour", "$/M samples"),
    )
    for s in result.scenarios:
        plan_x, even_x = result.speedup(s, "plan"), result.speedup(s, "even_dp")
        if plan_x is not None and even_x is not None and even_x < 1 - NOISE < 1 + NOISE < plan_x:
            console.print(
                f"{s.label}: even data parallelism gets slower ({_times(even_x)}), heterog's plan faster "
                f"({_times(plan_x)})."
            )
