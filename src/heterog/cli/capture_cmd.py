"""`heterog capture` (model → OpGraph summary / file) and `heterog models` (the zoo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from heterog.capture.models import MODELS
from heterog.cli.output import WIDE_HELP, console, parse_model_args, print_json, print_table, set_wide
from heterog.fmt import human_bytes, human_flops


def capture_summary(graph: Any) -> dict[str, Any]:
    """The --json document of `heterog capture` (and of capture scripts)."""
    return {
        "model": graph.model,
        "batch_size": graph.batch_size,
        "seq_len": graph.seq_len,
        "num_nodes": len(graph.nodes),
        "num_edges": len(graph.edges),
        "num_parameters": graph.num_parameters,
        "parameter_bytes": graph.param_bytes(),
        "forward_flops": graph.forward_flops(),
        "backward_flops": graph.backward_flops(),
        "saved_activation_bytes": graph.saved_activation_bytes(),
        "input_bytes": graph.input_bytes.at(graph.batch_size),
        "capture_time_s": graph.meta.get("capture_time_s"),
    }


def _show(graph: Any, top: int) -> None:
    b = graph.batch_size
    by_kind: dict[str, list[float]] = {}
    for n in graph.nodes:
        row = by_kind.setdefault(n.kind, [0, 0.0, 0.0, 0.0, 0])
        row[0] += 1
        row[1] += n.fwd_flops.at(b)
        row[2] += n.bwd_flops.at(b)
        row[3] += n.saved_bytes.at(b)
        row[4] += n.param_count
    total = graph.forward_flops() + graph.backward_flops() or 1.0
    rows = [
        [
            k,
            int(v[0]),
            human_flops(v[1]),
            human_flops(v[2]),
            f"{100 * (v[1] + v[2]) / total:.1f}%",
            human_bytes(v[3]),
            f"{int(v[4]):,}",
        ]
        for k, v in sorted(by_kind.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    ]
    print_table(
        f"{graph.model}: batch {b}" + (f", seq_len {graph.seq_len}" if graph.seq_len else ""),
        ["kind", "nodes", "fwd", "bwd", "share", "saved", "params"],
        rows,
        optional=("share", "saved"),
    )
    heavy = sorted(graph.nodes, key=lambda n: -(n.fwd_flops.at(b) + n.bwd_flops.at(b)))[:top]
    print_table(
        f"top {len(heavy)} nodes by FLOPs",
        ["node", "kind", "fwd", "bwd", "saved", "output"],
        [
            [
                n.name,
                n.kind,
                human_flops(n.fwd_flops.at(b)),
                human_flops(n.bwd_flops.at(b)),
                human_bytes(n.saved_bytes.at(b)),
                human_bytes(n.output_bytes.at(b)),
            ]
            for n in heavy
        ],
        optional=("kind", "saved", "output"),
    )
    s = capture_summary(graph)
    console.print(
        f"{s['num_nodes']} nodes, {s['num_edges']} edges, {s['num_parameters']:,} parameters "
        f"({human_bytes(s['parameter_bytes'])}); forward {human_flops(s['forward_flops'])}, "
        f"backward {human_flops(s['backward_flops'])}, saved activations "
        f"{human_bytes(s['saved_activation_bytes'])}; captured in {s['capture_time_s']:.1f} s"
    )


def capture_command(
    model: str = typer.Option(..., "--model", help="Zoo model name (heterog models) or path/file.py:factory."),
    model_arg: list[str] | None = typer.Option(None, "--model-arg", help="Model argument key=value (repeatable)."),
    batch_size: int = typer.Option(..., "--batch-size", min=1, help="Batch size of the captured iteration."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Sequence length (language models)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary document."),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    out: Path | None = typer.Option(None, "--out", help="Write the full OpGraph (JSON) here."),
    top: int = typer.Option(10, "--top", min=0, help="How many of the heaviest nodes to list."),
) -> None:
    """Capture one training iteration of MODEL on fake tensors (no memory for weights) as an OpGraph."""
    set_wide(wide)
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.capture import capture_model

    graph = capture_model(model, parse_model_args(model_arg), batch_size=batch_size, seq_len=seq_len)
    if out is not None:
        graph.save(out)
    if as_json:
        summary = capture_summary(graph)
        if out is not None:
            summary["out"] = str(out)
        print_json(summary)
        return
    _show(graph, top)
    if out is not None:
        console.print(f"wrote {out}")


def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """List the built-in models with their parameter counts at default arguments."""
    rows = [
        {
            "name": m.name,
            "family": m.family,
            "description": m.description,
            "num_parameters": m.num_parameters,
            "reference_parameters": m.reference_params,
            "reference_source": m.reference_source,
            "default_batch_size": m.default_batch_size,
            "default_seq_len": m.default_seq_len,
            "max_seq_len": m.max_seq_len,
            "image_size": m.image_size,
        }
        for m in MODELS
    ]
    if as_json:
        print_json(rows)
        return
    print_table(
        "model zoo (user models: --model path/file.py:factory)",
        ["name", "parameters", "family", "max seq", "description"],
        [
            [
                r["name"],
                f"{r['num_parameters']:,}",
                r["family"],
                f"{r['max_seq_len']:,}" if r["max_seq_len"] else "—",
                r["description"],
            ]
            for r in rows
        ],
    )


def register(app: typer.Typer) -> None:
    app.command("capture")(capture_command)
    app.command("models")(models_command)
