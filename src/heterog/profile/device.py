"""`heterog profile`: measure the device at hand — GEMM throughput at a few sizes, a copy's
bandwidth, the host's time per op (dispatch, autograd, autocast casts, module calls),
all-reduce and point-to-point bandwidth between two ranks, whole training steps, and
per-node forward/backward times of a model — into a DeviceProfile (cost/device_profile.py)
that `heterog calibrate`, `heterog predict --profile` and `heterog plan --profile` read.

On a GPU (CUDA) every timing synchronises the device around the timed region; host costs
are measured on ops too small to keep the GPU busy, so the wall time per op is the host's.
On the CPU the same code runs without synchronisation. The CUDA branches have not been run
on a GPU yet: treat a GPU profile as unverified.
"""

from __future__ import annotations

import datetime
import functools
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from heterog.cost.device_profile import DeviceProfileError

GEMM_SIZES_GPU = (512, 1024, 2048, 4096, 8192)
GEMM_SIZES_CPU = (128, 256, 512, 1024)
COMM_BYTES = (2**20, 16 * 2**20)
CHAIN_OPS = 200  # tiny ops per host-cost measurement
COMM_TIMEOUT_S = 120


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_s(fn: Callable[[], Any], dev: torch.device, *, repeats: int = 5) -> float:
    """Median wall time of fn() after one warm-up call, the device synchronised around each."""
    fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm(dev: torch.device, *, quick: bool = False) -> list[dict[str, Any]]:
    """Square n×n×n products: [{'n', 'dtype', 'time_s'}] (the format of h200_micro.json's
    'matmul' rows, in seconds). On CUDA also fp16, and tf32: fp32 tensors with
    torch.backends.cuda.matmul.allow_tf32 on for the measurement."""
    sizes: tuple[int, ...] = GEMM_SIZES_GPU if dev.type == "cuda" else GEMM_SIZES_CPU
    sizes = sizes[:3] if quick else sizes
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if dev.type == "cuda":
        dtypes.update(fp16=torch.float16, tf32=torch.float32)
    rows = []
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dt in dtypes.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            for n in sizes:
                a = torch.randn(n, n, device=dev, dtype=dt)
                b = torch.randn(n, n, device=dev, dtype=dt)
                rows.append({"n": n, "dtype": name, "time_s": timed_s(functools.partial(torch.mm, a, b), dev)})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return rows


def measure_copy(dev: torch.device, *, quick: bool = False) -> dict[str, float]:
    """A large device-to-device copy: bytes read + written per second."""
    numel = (256 if dev.type == "cuda" else 16) * 2**20 // (4 if quick else 1)
    src = torch.randn(numel, device=dev)
    dst = torch.empty_like(src)
    t = timed_s(lambda: dst.copy_(src), dev)
    return {"bytes": float(2 * numel * 4), "time_s": t}


def measure_host(dev: torch.device) -> dict[str, float]:
    """Host seconds per op: forward dispatch, autograd backward, an autocast cast, and a
    module call (nn.Module.__call__ around one op), on tensors too small to occupy the device."""
    p = torch.ones(4, device=dev, requires_grad=True)
    q = torch.ones(4, device=dev)

    def chain():
        y = p
        for _ in range(CHAIN_OPS):
            y = y * q
        return y

    fwd = timed_s(chain, dev) / CHAIN_OPS
    both = timed_s(lambda: chain().sum().backward(), dev) / CHAIN_OPS
    lin = nn.Linear(4, 4).to(dev)
    x = torch.ones(2, 4, device=dev)
    layers = nn.Sequential(*[nn.Identity() for _ in range(CHAIN_OPS)])
    call = timed_s(lambda: layers(x), dev) / CHAIN_OPS

    def linears():
        y = x
        for _ in range(CHAIN_OPS // 4):
            y = lin(y)
        return y

    plain = timed_s(linears, dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        cast = timed_s(linears, dev)
    # under autocast each linear casts its input (the weight and bias casts are cached only
    # inside one autocast region: here each call is its own, so three casts per linear)
    cast_s = max(cast - plain, 0.0) / (3 * (CHAIN_OPS // 4))
    return {
        "forward_op_s": fwd,
        "backward_op_s": max(both - fwd, 0.0),
        "module_call_s": call,
        "autocast_cast_s": cast_s,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm_rank(rank: int, world: int, port: int, backend: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    rows = []
    for nbytes in COMM_BYTES:
        t = torch.ones(nbytes // 4, device=dev)
        ar = timed_s(functools.partial(dist.all_reduce, t), dev, repeats=3)

        def p2p(t: torch.Tensor = t) -> None:
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)

        dist.barrier()
        pp = timed_s(p2p, dev, repeats=3)
        rows.append({"bytes": nbytes, "allreduce_s": ar, "p2p_s": pp})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def measure_comm(dev: torch.device) -> dict[str, Any]:
    """All-reduce and point-to-point between two ranks: NCCL across two visible GPUs, gloo
    between two local processes otherwise."""
    backend = "nccl" if dev.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_comm_rank, args=(r, 2, port, backend, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rows = out.get(timeout=COMM_TIMEOUT_S)
    except queue.Empty:
        raise DeviceProfileError(
            f"the two-rank {backend} measurement did not finish within {COMM_TIMEOUT_S} s "
            f"(a rank failed to start or connect on 127.0.0.1); rerun with --no-comm to "
            f"skip it."
        ) from None
    finally:
        for p in procs:
            p.join(timeout=30)
    return {"backend": backend, "world_size": 2, "rows": rows}
