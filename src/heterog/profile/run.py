"""Run every measurement of `heterog profile` and assemble the DeviceProfile."""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import time
from typing import Any

import torch

from heterog.cost.calibrate import fit_host_speed
from heterog.cost.device_profile import DeviceProfile
from heterog.hardware.catalog import get_gpu, gpu_from_device_name
from heterog.ir.kinds import HALF_PRECISIONS, Precision
from heterog.ir.plan import ModelSpec
from heterog.profile.device import measure_comm, measure_copy, measure_gemm, measure_host, pick_device, timed_s
from heterog.profile.measure import measure_profile
from heterog.workload import build_model, global_batch, make_optimizer, resolve_workload


def device_type_of(dev: torch.device) -> tuple[str, str]:
    """(catalog type, device name): a GPU's catalog type from its name and memory; 'cpu'."""
    if dev.type != "cuda":
        return "cpu", platform.processor() or platform.machine()
    props = torch.cuda.get_device_properties(dev)
    return gpu_from_device_name(props.name, props.total_memory).name, props.name


# fp16 steps scale the loss as the executor's LossScaler does (a constant here: the step's
# kernels are what is timed, not the scale's dynamics)
FP16_LOSS_SCALE = 2.0**16


@contextlib.contextmanager
def precision_context(precision: str, dev: torch.device):
    """A step's forward in the plan precision: autocast to bf16/fp16; tf32 turns on TF32
    matmuls (cuDNN convolutions use TF32 by default) for the step; fp32 as it is."""
    if precision in HALF_PRECISIONS:
        with torch.autocast(dev.type, dtype=torch.bfloat16 if precision == Precision.AMP_BF16 else torch.float16):
            yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == Precision.TF32 or before
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def measure_steps(
    model: str,
    model_args: dict[str, Any] | None,
    batch_sizes: tuple[int, ...],
    seq_len: int | None,
    precision: str,
    optimizer: str,
    dev: torch.device,
) -> list[dict]:
    """Whole training steps (zero_grad, forward, loss, backward, optimizer step) per batch size:
    median time, and on a GPU the peak allocated memory."""
    work = resolve_workload(ModelSpec(name=model, args=dict(model_args or {}), seq_len=seq_len))
    net = build_model(work, seed=0).to(dev)
    opt = make_optimizer(list(net.parameters()), optimizer)
    assert opt is not None, "a profiled model has parameters"
    rows = []
    for b in batch_sizes:
        inputs, targets = global_batch(work, b, seed=0, step=0)
        inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs)
        targets = targets.to(dev) if isinstance(targets, torch.Tensor) else targets

        def step(inputs: tuple = inputs, targets: Any = targets) -> None:
            opt.zero_grad(set_to_none=True)
            with precision_context(precision, dev):
                loss = work.loss(net(*inputs), targets)
            (loss * FP16_LOSS_SCALE if precision == Precision.FP16 else loss).backward()
            opt.step()

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = timed_s(step, dev, repeats=3)
        peak = float(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
        rows.append(
            {
                "model": model,
                "batch_size": b,
                "seq_len": work.seq_len,
                "precision": precision,
                "optimizer": optimizer,
                "recompute": False,
                "time_s": t,
                "peak_bytes": peak,
            }
        )
    return rows


def profile_device(
    *,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    batch_sizes: tuple[int, ...] = (1, 4),
    seq_len: int | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
    device: str = "auto",
    quick: bool = False,
    comm: bool = True,
    say=lambda msg: None,
) -> DeviceProfile:
    """Measure the device (and, with `model`, its steps and per-node times)."""
    t0 = time.perf_counter()
    dev = pick_device(device)
    dtype, name = device_type_of(dev)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the cost model's `cpu` type is one thread (hardware.catalog)
    say(f"profiling {name} ({dtype}): GEMM")
    gemm = measure_gemm(dev, quick=quick)
    say("copy bandwidth, host costs per op")
    copy, host = measure_copy(dev, quick=quick), measure_host(dev)
    comm_doc = None
    if comm:
        say("all-reduce and point-to-point between two ranks")
        comm_doc = measure_comm(dev)
    steps, nodes = [], None
    if model is not None:
        say(f"{model}: whole steps and per-node times at batch {', '.join(map(str, batch_sizes))}")
        steps = measure_steps(model, model_args, batch_sizes, seq_len, precision, optimizer, dev)
        if dev.type == "cpu":  # per-node hooks time the CPU's own work (profile/measure.py)
            work = resolve_workload(ModelSpec(name=model, args=dict(model_args or {}), seq_len=seq_len))
            nodes = measure_profile(work, batch_sizes=batch_sizes, repeats=3, device_type=dtype)
    prof = DeviceProfile(
        device={
            "type": dtype,
            "name": name,
            "torch": torch.__version__,
            "host": platform.processor() or platform.machine(),
        },
        gemm=tuple(gemm),
        copy=copy,
        host=host,
        comm=comm_doc,
        steps=tuple(steps),
        nodes=nodes,
        meta={"profile_time_s": time.perf_counter() - t0},
    )
    if steps and dev.type == "cuda":
        # the node's host speed: how fast this host drives the GPU relative to the reference
        # host, from the measured steps (the small-batch ones are the host's)
        say("host speed from the measured steps")
        prof = dataclasses.replace(prof, host_speed=fit_host_speed(prof, get_gpu(dtype)))
    return prof
