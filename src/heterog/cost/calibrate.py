"""`heterog calibrate`: from a measured device profile, a catalog entry for the device type.

What is fitted, and from what (cost/device_profile.py names the sections):
- compute[p], per GEMM precision measured: the median, over the larger half of the measured
  sizes, of (measured FLOP/s / peak) ÷ (the efficiency the H200-calibrated curve gives a type
  of this peak, hardware.efficiency.gpu_curve). 1.0 means "behaves like the scaled H200";
  a power-limited card comes out below 1.
- memory: the copy's bytes per second over the data-sheet bandwidth.
- host costs: the per-op host times measured directly (module call, dispatch, autograd,
  autocast cast); when the profile holds whole steps of zoo models, one common scale on
  all host costs is then fitted so that the predicted steps match the measured ones in the
  median (the micro-benchmarks miss Python work that real models do between ops).
- host speed (`fit_host_speed`): the same fit against the catalog's reference host costs,
  inverted — how fast this machine's host is relative to the reference host. It is a
  property of the node, written as `host_speed` in the cluster YAML, for nodes whose devices
  keep the packaged type (a calibrated type already carries this host's costs).
The entry keeps the base type's peaks, memory and links (`--base`, or the profile's own
device type), so it names the same hardware with this machine's measured behaviour.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
from typing import Any

import numpy as np
import psutil

from heterog.cost.device_profile import DeviceProfile
from heterog.cost.predict import _captured, predict
from heterog.errors import ClusterError
from heterog.hardware.catalog import get_gpu, host_costs
from heterog.hardware.efficiency import gpu_curve
from heterog.hardware.gputype import Efficiency, GpuType, HostCosts

HOST_SCALE_BOUNDS = (0.2, 5.0)


def compute_factors(profile: DeviceProfile, base: GpuType) -> dict[str, float]:
    plain = dataclasses.replace(base, efficiency=Efficiency())
    out = {}
    for dtype in sorted({g["dtype"] for g in profile.gemm}):
        peak = base.peak_flops_per_s.get(dtype, 0.0)
        rows = sorted((g["n"], g["time_s"]) for g in profile.gemm if g["dtype"] == dtype)
        if peak <= 0 or not rows:
            continue
        big = rows[len(rows) // 2 :]
        curve = gpu_curve(plain, dtype)
        ratios = [(2 * n**3 / t / peak) / float(curve.at(n)) for n, t in big]
        out[dtype] = float(np.clip(statistics.median(ratios), 0.05, 4.0))
    return out


def measured_host(profile: DeviceProfile, base: GpuType) -> HostCosts:
    default = host_costs(base)
    h = profile.host or {}
    if not h:
        return default
    fwd = h.get("forward_op_s", default.forward_op_s)
    return dataclasses.replace(
        default,
        forward_node_s=h.get("module_call_s", 0.0) + fwd,
        forward_op_s=fwd,
        backward_op_s=h.get("backward_op_s", default.backward_op_s),
        autocast_cast_s=h.get("autocast_cast_s", default.autocast_cast_s),
    )


def scale_host(host: HostCosts, k: float) -> HostCosts:
    return dataclasses.replace(
        host,
        **{
            f: getattr(host, f) * k
            for f in (
                "forward_node_s",
                "forward_op_s",
                "backward_op_s",
                "autocast_cast_s",
                "optimizer_tensor_s",
                "cudnn_op_s",
            )
        },
    )


def _step_errors(profile: DeviceProfile, gpu: GpuType) -> list[float]:
    errs = []
    for s in profile.steps:
        graph = _captured(s["model"], s.get("model_args"), 1, s.get("seq_len"))
        r = predict(
            graph,
            batch_size=s["batch_size"],
            device=gpu,
            precision=s.get("precision", "fp32"),
            optimizer=s.get("optimizer", "sgd"),
            recompute=bool(s.get("recompute")),
        )
        errs.append(float(np.log(r["iteration_time_s"] / s["time_s"])))
    return errs


def fit_host_scale(profile: DeviceProfile, gpu: GpuType) -> float:
    """The common host-cost scale that makes the median step error smallest."""
    # scipy only for this fit: building a cost model does not load it
    from scipy.optimize import minimize_scalar

    host = gpu.host or host_costs(gpu)
    lo, hi = np.log(HOST_SCALE_BOUNDS)

    def objective(logk: float) -> float:
        g = dataclasses.replace(gpu, host=scale_host(host, float(np.exp(logk))))
        return float(np.median(np.abs(_step_errors(profile, g))))

    res = minimize_scalar(objective, bounds=(lo, hi), method="bounded", options={"xatol": 0.02})
    return float(np.exp(res.x))


CUDNN_PROFILE_OPS = frozenset(
    {
        "aten::cudnn_convolution",
        "aten::convolution_backward",
        "aten::_cudnn_attention_forward",
        "aten::_cudnn_attention_backward",
    }
)


def cudnn_op_host_s(op_profiles: list[dict[str, Any]]) -> float | None:
    """Extra host time per cuDNN frontend call, measured on per-op profiles in the format of
    h200_steps.json's `op_profiles` (per aten op: count, cpu_us): each cuDNN op's host time per
    call less the median per-call host time of the profile's other kernel-launching ops, the
    mean over every cuDNN call. None if the profiles hold no cuDNN op."""
    extra_us, calls = 0.0, 0
    for p in op_profiles:
        ordinary = sorted(
            o["cpu_us"] / o["count"]
            for o in p["ops"]
            for _ in range(int(o["count"]))
            if o["op"] not in CUDNN_PROFILE_OPS and o["self_device_us"] > 0
        )
        base_us = ordinary[len(ordinary) // 2] if ordinary else 0.0
        for o in p["ops"]:
            if o["op"] in CUDNN_PROFILE_OPS:
                extra_us += o["cpu_us"] - base_us * o["count"]
                calls += int(o["count"])
    return None if calls == 0 else max(extra_us / calls, 0.0) * 1e-6


# What autocast runs for one cast: aten::to -> aten::_to_copy -> empty_strided + copy_
CAST_PROFILE_OP = "aten::to"


def cast_op_host_s(op_profiles: list[dict[str, Any]]) -> float | None:
    """Host time per autocast cast, measured on per-op profiles in the format of
    h200_steps.json's `op_profiles`: the mean host time (children included) of an
    `aten::to` call in the half-precision profiles. A cast is an op of its own, added to
    the step (not an ordinary op made dearer), so its whole host time counts. None if no
    half-precision profile is given. gpt2-medium's bf16 step: 777 calls, 18.1 µs each."""
    total_us, calls = 0.0, 0
    for p in op_profiles:
        if p.get("mode") not in ("bf16", "fp16"):
            continue
        for o in p["ops"]:
            if o["op"] == CAST_PROFILE_OP:
                total_us += o["cpu_us"]
                calls += int(o["count"])
    return None if calls == 0 else total_us / calls * 1e-6


def fit_host_speed(profile: DeviceProfile, base: GpuType) -> float | None:
    """This machine's host speed relative to the reference host (the catalog's host costs):
    1 / the common scale on those costs that best matches the profile's measured GPU steps.
    None when there is nothing to fit (no steps, or a CPU device, whose host is its compute)."""
    if not profile.steps or base.vendor == "cpu":
        return None
    return 1.0 / fit_host_scale(profile, dataclasses.replace(base, host=None))


def calibrate(profile: DeviceProfile, *, name: str | None = None, base: str | None = None) -> dict[str, Any]:
    """The catalog entry (a dict in catalog.yaml's format) for the profiled device."""
    base_name = base or profile.device_type
    try:
        base_type = get_gpu(base_name)
    except ClusterError as e:
        raise ClusterError(
            f"calibrate needs a base GPU type for the data-sheet peaks: {e} Pass --base "
            f"with the catalog type of the profiled device."
        ) from None
    if base_type.vendor == "cpu":
        return cpu_entry(profile, name)
    mem = profile.copy_bandwidth_bytes_per_s()
    eff = Efficiency(
        compute=compute_factors(profile, base_type) or dict(base_type.efficiency.compute),
        conv=dict(base_type.efficiency.conv),
        memory=None if mem is None else float(min(mem / base_type.memory_bandwidth_bytes_per_s, 1.0)),
        memory_by_kind=dict(base_type.efficiency.memory_by_kind),
        inherits=base_type.name,
        source=f"heterog calibrate on a profile of {profile.device.get('name') or base_type.name}",
    )
    host = measured_host(profile, base_type)
    gpu = dataclasses.replace(base_type, name=name or base_type.name, efficiency=eff, host=host)
    scale = 1.0
    if profile.steps:
        scale = fit_host_scale(profile, gpu)
        host = scale_host(host, scale)
    when = datetime.date.today().isoformat()
    return {
        "name": name or base_type.name,
        "vendor": base_type.vendor,
        "peak_tflops": {p: v / 1e12 for p, v in base_type.peak_flops_per_s.items()},
        "memory_bandwidth_gbytes_per_s": base_type.memory_bandwidth_bytes_per_s / 1e9,
        "memory_gib": base_type.memory_bytes / 2**30,
        "intra_node_link": base_type.intra_node_link,
        "intra_node_bandwidth_gbytes_per_s": base_type.intra_node_bandwidth_bytes_per_s / 1e9,
        "sources": {**base_type.sources, "calibration": f"heterog calibrate ({when}); base type {base_type.name}"},
        **({"public": base_type.public.to_dict()} if base_type.public is not None else {}),
        "efficiency": {
            "compute": eff.compute,
            **({"conv": eff.conv} if eff.conv else {}),
            "memory": eff.memory,
            "memory_by_kind": eff.memory_by_kind,
            "inherits": eff.inherits,
            "source": eff.source,
        },
        "host": {
            **{
                f: getattr(host, f)
                for f in (
                    "forward_node_s",
                    "forward_op_s",
                    "backward_op_s",
                    "autocast_cast_s",
                    "optimizer_tensor_s",
                    "kernel_gap_s",
                    "cudnn_op_s",
                )
            },
            "source": _host_source(profile, base_type, scale),
        },
    }


def cpu_entry(profile: DeviceProfile, name: str | None) -> dict[str, Any]:
    """A catalog entry for the profiled CPU (vendor 'cpu'): its measured GEMM rates, copy
    bandwidth, two-rank point-to-point bandwidth and host time per op. The cost model's CPU
    path takes the rest (per-kind bandwidths, page faults) from this machine's own probe
    (hardware.cpu_probe.measure_cpu), as it does for the `cpu` type."""
    if not name or name.strip().lower() == "cpu":
        raise ClusterError(
            "a calibrated CPU needs a name of its own (--name, e.g. 'lab-cpu'): 'cpu' is the "
            "type every machine measures for itself."
        )
    peak = {
        p: max((2 * g["n"] ** 3 / g["time_s"] for g in profile.gemm if g["dtype"] == p), default=0.0) / 1e12
        for p in ("fp32", "tf32", "fp16", "bf16")
    }
    copy = profile.copy_bandwidth_bytes_per_s()
    if peak["fp32"] <= 0 or copy is None:
        raise ClusterError(
            "the CPU profile has no fp32 GEMM or no copy measurement; run `heterog profile` "
            "again without editing its file."
        )
    rows = (profile.comm or {}).get("rows", [])
    p2p = max((r["bytes"] / r["p2p_s"] for r in rows), default=2e9)
    where = profile.device.get("name") or "this machine"
    host = profile.host or {}
    op_s, bwd_s = host.get("forward_op_s", 0.0), host.get("backward_op_s", 0.0)
    return {
        "name": name,
        "vendor": "cpu",
        "peak_tflops": peak,
        "memory_bandwidth_gbytes_per_s": copy / 1e9,
        "memory_gib": psutil.virtual_memory().total / 2**30,
        "intra_node_link": "loopback",
        "intra_node_bandwidth_gbytes_per_s": p2p / 1e9,
        "sources": {
            "peak_tflops": f"measured by heterog profile on {where}: the fastest square GEMM per precision",
            "memory": f"measured by heterog profile on {where}: a copy's bytes read + written per second",
            "intra_node_link": "measured by heterog profile: gloo point-to-point between two local ranks"
            if rows
            else "gloo between local processes, ~2 GB/s (not measured)",
            "calibration": f"heterog calibrate ({datetime.date.today().isoformat()}) of a CPU profile",
        },
        **(
            {
                "host": {
                    "forward_node_s": host.get("module_call_s", 0.0) + op_s,
                    "forward_op_s": op_s,
                    "backward_op_s": bwd_s,
                    "autocast_cast_s": host.get("autocast_cast_s", 0.0),
                    "optimizer_tensor_s": op_s,
                    "kernel_gap_s": 0.0,
                    "source": f"measured per-op host times on {where}",
                }
            }
            if op_s > 0
            else {}
        ),
    }


def _host_source(profile: DeviceProfile, base: GpuType, scale: float) -> str:
    what = (
        "measured per-op host times" if profile.host else f"the catalog's host costs for {base.vendor} (not measured)"
    )
    if profile.steps:
        return f"{what} × {scale:.3g} (one scale fitted on {len(profile.steps)} measured steps)"
    return what
