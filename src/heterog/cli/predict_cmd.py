"""`heterog predict`, `heterog gpus`, `heterog clusters`."""

from __future__ import annotations

from collections import Counter

import typer

from heterog.cli.output import WIDE_HELP, console, parse_model_args, print_json, print_table, set_wide
from heterog.fmt import human_bytes, human_flops, human_time, human_usd
from heterog.hardware.catalog import list_gpus, precision_help
from heterog.hardware.spec import builtin_clusters, load_cluster
from heterog.ir.kinds import Precision


def predict_cmd(
    model: str = typer.Option(..., "--model", help="Zoo name (`heterog models`) or path/file.py:factory."),
    model_arg: list[str] | None = typer.Option(None, "--model-arg", help="Model argument key=value (repeatable)."),
    batch_size: int = typer.Option(..., "--batch-size", min=1),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1),
    device: str = typer.Option(..., "--device", help="GPU type (`heterog gpus`) or 'cpu'."),
    precision: str = typer.Option("fp32", "--precision", help=precision_help()),
    optimizer: str = typer.Option("sgd", "--optimizer", help="sgd (with momentum) | adamw"),
    recompute: bool = typer.Option(False, "--recompute", help="Checkpoint each transformer/residual block."),
    profile: str | None = typer.Option(
        None,
        "--profile",
        help="Measured per-node times (`heterog profile --model` output) that replace the analytic ones on --device.",
    ),
    host_speed: float = typer.Option(
        1.0,
        "--host-speed",
        help="Speed of the host driving the GPU relative "
        "to the reference host (a cluster node's host_speed; `heterog profile` "
        "measures it).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Predict one training step (forward, backward, optimizer) on one device type."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.cost.predict import predict

    result = predict(
        model,
        model_args=parse_model_args(model_arg),
        batch_size=batch_size,
        seq_len=seq_len,
        device=device,
        precision=precision,
        optimizer=optimizer,
        recompute=recompute,
        profile=profile,
        host_speed=host_speed,
    )
    if as_json:
        print_json(result)
        return
    _print_prediction(result, batch_size, precision, optimizer, recompute)


def _print_prediction(result: dict, batch_size: int, precision: str, optimizer: str, recompute: bool) -> None:
    b = result["breakdown"]
    rows = [
        ("iteration time", human_time(result["iteration_time_s"])),
        ("  forward", human_time(b["forward_s"])),
        ("  backward", human_time(b["backward_s"])),
        ("  recompute", human_time(b["recompute_s"])),
        ("  optimizer", human_time(b["optimizer_s"])),
        ("FLOPs per iteration", human_flops(result["flops_per_iteration"])),
        ("achieved FLOP/s", human_flops(b["achieved_flops_per_s"]) + "/s"),
        ("peak memory", f"{human_bytes(result['peak_memory_bytes'])} (in {b['peak_phase']})"),
        ("  parameters", human_bytes(b["params_bytes"])),
        ("  gradients", human_bytes(b["grads_bytes"])),
        ("  optimizer state", human_bytes(b["optimizer_state_bytes"])),
        ("  activations", human_bytes(b["activations_bytes"])),
        ("  transient", human_bytes(b["transient_bytes"])),
        ("device memory", human_bytes(result["device_memory_bytes"])),
        ("fits", "yes" if result["fits"] else "NO"),
    ]
    rows += [(f"slowest: {t['node']}", f"{human_time(t['time_s'])} ({t['kind']})") for t in b["top_nodes"]]
    print_table(
        f"{result['model']} × batch {batch_size} on {result['device']} "
        f"({precision}, {optimizer}{', recompute' if recompute else ''})",
        ["", "predicted"],
        rows,
    )
    for note in result["notes"]:
        console.print(f"  • {note}")


def gpus_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
    cpu: bool = typer.Option(True, "--cpu/--no-cpu", help="Include the measured 'cpu' type."),
) -> None:
    """List the GPU catalog (dense peaks, memory, links, list price per hour) and their sources."""
    set_wide(wide)
    gpus = list_gpus(include_cpu=cpu)
    if as_json:
        print_json(
            [
                {
                    "name": g.name,
                    "vendor": g.vendor,
                    "peak_flops_per_s": g.peak_flops_per_s,
                    "memory_bandwidth_bytes_per_s": g.memory_bandwidth_bytes_per_s,
                    "memory_bytes": g.memory_bytes,
                    "intra_node_link": g.intra_node_link,
                    "intra_node_bandwidth_bytes_per_s": g.intra_node_bandwidth_bytes_per_s,
                    "fast_precisions": fast(g),
                    "efficiency_source": g.efficiency.source,
                    "public": None if g.public is None else g.public.to_dict(),
                    "sources": g.sources,
                    "price": None if g.price is None else g.price.to_dict(),
                }
                for g in gpus
            ]
        )
        return
    tf = lambda g, p: f"{g.peak_flops_per_s.get(p, 0) / 1e12:.1f}" if g.peak_flops_per_s.get(p) else "—"  # noqa: E731
    print_table(
        "GPU types (dense peak TFLOP/s)",
        [
            "type",
            "fp32",
            "tf32",
            "fp16",
            "bf16",
            "fast precisions",
            "memory",
            "mem GB/s",
            "link",
            "link GB/s",
            "$/hour",
        ],
        [
            (
                g.name,
                tf(g, "fp32"),
                tf(g, "tf32"),
                tf(g, "fp16"),
                tf(g, "bf16"),
                " ".join(fast(g)) or "—",
                human_bytes(g.memory_bytes),
                f"{g.memory_bandwidth_bytes_per_s / 1e9:.0f}",
                g.intra_node_link,
                f"{g.intra_node_bandwidth_bytes_per_s / 1e9:.0f}",
                "—" if g.price is None else human_usd(g.price.usd_per_hour),
            )
            for g in gpus
        ],
        optional=("link", "fast precisions", "$/hour"),
    )


def fast(g) -> list[str]:
    """The plan precisions that run faster than fp32 on GPU type g."""
    return [p for p in (Precision.TF32, Precision.AMP_BF16, Precision.FP16) if g.vendor != "cpu" and g.accelerates(p)]


def clusters_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the built-in clusters (use their names wherever a cluster file is accepted)."""
    rows = []
    for name in builtin_clusters():
        c = load_cluster(name)
        types = Counter(d.gpu_type for d in c.devices)
        nics = sorted({n.nic_bandwidth_bytes_per_s * 8 / 1e9 for n in c.nodes})
        rows.append(
            {
                "name": name,
                "kind": c.kind,
                "devices": len(c.devices),
                "nodes": len(c.nodes),
                "gpu_types": dict(types),
                "nic_gbps": nics,
                "description": c.meta.get("description", ""),
            }
        )
    if as_json:
        print_json(rows)
        return
    print_table(
        "built-in clusters",
        ["name", "kind", "devices", "nodes", "GPU types", "NIC Gb/s"],
        [
            (
                r["name"],
                r["kind"],
                r["devices"],
                r["nodes"],
                ", ".join(f"{v}×{k}" for k, v in r["gpu_types"].items()),
                "/".join(f"{x:g}" for x in r["nic_gbps"]),
            )
            for r in rows
        ],
    )


def register(app: typer.Typer) -> None:
    app.command("predict")(predict_cmd)
    app.command("gpus")(gpus_cmd)
    app.command("clusters")(clusters_cmd)
