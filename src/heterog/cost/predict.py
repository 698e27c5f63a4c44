"""`heterog predict`: one training step (forward, backward, optimizer step) of a model on one
device type — time, peak memory, FLOPs, and whether it fits — from the capture and the
analytic cost model. Many predictions can run in one process (captures are cached)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from heterog.cost import build_cost_model
from heterog.cost.device_profile import DeviceProfile
from heterog.cost.memory import CUDA_CONTEXT_BYTES
from heterog.cost.precision import precision_advice
from heterog.cost.profile import Profile, ProfileError
from heterog.errors import ModelError
from heterog.hardware.catalog import get_gpu
from heterog.hardware.cluster import Cluster, build_cluster
from heterog.hardware.gputype import GpuType
from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpGraph

TOP_NODES = 5  # the slowest nodes (forward + backward) listed in the breakdown


def single_device_cluster(gpu: GpuType, host_speed: float = 1.0) -> Cluster:
    """A one-device cluster of type `gpu` (device 'local/gpu0', or 'local/cpu0') on a node
    whose host runs at `host_speed` × the reference host."""
    dev = f"local/{'cpu' if gpu.vendor == 'cpu' else 'gpu'}0"
    return build_cluster(
        name=f"single-{gpu.name}",
        gpu_types={gpu.name: gpu},
        nodes=[
            {
                "name": "local",
                "devices": [{"name": dev, "gpu_type": gpu.name}],
                "nic_bandwidth_bytes_per_s": 1e10,
                "nic_latency_s": 0.0,
                "intra_latency_s": 0.0,
                "host_speed": host_speed,
            }
        ],
    )


def _freeze(args: dict[str, Any] | None) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in (args or {}).items()))


_CAPTURES: dict[tuple, OpGraph] = {}
_MAX_CAPTURES = 32


def _captured(model: str, model_args: dict[str, Any] | None, batch_size: int, seq_len: int | None) -> OpGraph:
    key = (model, _freeze(model_args), batch_size, seq_len)
    graph = _CAPTURES.get(key)
    if graph is None:
        # capturing a graph imports torch: a cached graph is read without it
        from heterog.capture import capture_model

        graph = capture_model(model, model_args, batch_size=batch_size, seq_len=seq_len)
        if len(_CAPTURES) >= _MAX_CAPTURES:
            _CAPTURES.pop(next(iter(_CAPTURES)))
        _CAPTURES[key] = graph
    return graph


def _graph(model: str | OpGraph, model_args: dict[str, Any] | None, batch_size: int, seq_len: int | None) -> OpGraph:
    if isinstance(model, OpGraph):
        return model
    if not isinstance(model, str):
        raise ModelError(
            f"model must be a zoo name, 'path/file.py:factory' or an OpGraph, found {type(model).__name__}."
        )
    return _captured(model, model_args, batch_size, seq_len)


def node_profile(profile: Any):
    """The per-node times of `profile`: a Profile, a DeviceProfile (its `nodes`), or a file of
    either; None stays None."""
    if profile is None:
        return None
    if isinstance(profile, (str, Path)):
        try:
            kind = json.loads(Path(profile).read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        profile = DeviceProfile.load(profile) if kind == "heterog.DeviceProfile" else Profile.load(profile)
    if isinstance(profile, DeviceProfile):
        if profile.nodes is None:
            raise ProfileError(
                f"the device profile of {profile.device.get('name') or profile.device_type} holds no "
                f"per-node times; run `heterog profile --model NAME` to measure them."
            )
        return profile.nodes
    return profile


def predict(
    model: str | OpGraph,
    *,
    model_args: dict[str, Any] | None = None,
    batch_size: int,
    seq_len: int | None = None,
    device: str | GpuType,
    precision: str = "fp32",
    optimizer: str = "sgd",
    recompute: bool = False,
    profile: Any = None,
    host_speed: float = 1.0,
) -> dict[str, Any]:
    """One training step of `model` at `batch_size` on one `device` type (a catalog name,
    'cpu', or a GpuType such as a calibration's). Returns iteration_time_s,
    peak_memory_bytes, flops_per_iteration, fits, device, and a breakdown (times in s, sizes
    in bytes). `profile` (a Profile, a DeviceProfile, or the path of either) replaces the
    analytic time of every node it measured on this device type. `host_speed` is the speed of
    the host driving the GPU relative to the reference host (a cluster YAML's node
    `host_speed`; `heterog profile` measures it)."""
    if batch_size < 1:
        raise ModelError(f"batch_size must be ≥ 1, found {batch_size}.")
    gpu = device if isinstance(device, GpuType) else get_gpu(device)
    graph = _graph(model, model_args, batch_size, seq_len)
    if not (host_speed > 0):
        raise ModelError(f"host_speed must be > 0 (1.0 = the reference host), found {host_speed!r}.")
    cluster = single_device_cluster(gpu, host_speed)
    dev = cluster.devices[0].name
    costs = build_cost_model(
        graph, cluster, precision=precision, optimizer=optimizer, recompute=recompute, profile=node_profile(profile)
    )
    names = [n.name for n in graph.nodes]
    fwd_s = costs.group_time_s(names, dev, batch_size, Phase.FORWARD)
    bwd_s = costs.group_time_s(names, dev, batch_size, Phase.BACKWARD)
    recompute_s = costs.recompute_time_s(names, dev, batch_size) if recompute else 0.0
    opt_s = costs.optimizer_time_s(names, dev)
    mem = costs.memory.step_peak(batch_size, recompute=recompute)
    context = 0 if gpu.vendor == "cpu" else CUDA_CONTEXT_BYTES
    flops = graph.forward_flops(batch_size) + graph.backward_flops(batch_size)
    if recompute:
        in_block = costs.memory.in_block()
        flops += sum(n.fwd_flops.at(batch_size) for n, b in zip(graph.nodes, in_block) if b)
    iteration_s = fwd_s + bwd_s + opt_s
    return {
        "model": graph.model,
        "device": gpu.name,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "precision": precision,
        "optimizer": optimizer,
        "recompute": recompute,
        "host_speed": host_speed,
        "iteration_time_s": iteration_s,
        "peak_memory_bytes": int(round(mem.peak_bytes)),
        "flops_per_iteration": flops,
        "fits": bool(mem.reserved_bytes + context <= gpu.memory_bytes),
        "device_memory_bytes": gpu.memory_bytes,
        # how this device runs the precision (its fp32 rate where it has no fast path for it)
        "precision_runs_as": gpu.catalog_precision(precision),
        "notes": list(precision_advice(cluster, precision).notes),
        "breakdown": {
            "forward_s": fwd_s,
            "backward_s": bwd_s - recompute_s,
            "recompute_s": recompute_s,
            "optimizer_s": opt_s,
            "achieved_flops_per_s": flops / iteration_s if iteration_s > 0 else 0.0,
            "params_bytes": mem.params_bytes,
            "grads_bytes": mem.grads_bytes,
            "optimizer_state_bytes": mem.optimizer_state_bytes,
            "activations_bytes": mem.activations_bytes,
            "transient_bytes": mem.transient_bytes,
            "peak_phase": mem.peak_phase,
            "reserved_bytes": mem.reserved_bytes,
            "context_bytes": context,
            "num_nodes": len(graph.nodes),
            "top_nodes": _top_nodes(costs, graph, dev, batch_size),
            "num_parameters": graph.num_parameters,
        },
    }


def _top_nodes(costs: Any, graph: OpGraph, dev: str, batch_size: int) -> list[dict[str, Any]]:
    """The TOP_NODES slowest nodes of a step (forward and backward together)."""
    names = [n.name for n in graph.nodes]
    node_s = costs.node_times_s(names, dev, batch_size, Phase.FORWARD) + costs.node_times_s(
        names, dev, batch_size, Phase.BACKWARD
    )
    top = sorted(zip(names, node_s, (n.kind for n in graph.nodes)), key=lambda x: -x[1])[:TOP_NODES]
    return [{"node": n, "kind": k, "time_s": float(t)} for n, t, k in top]
