"""The one prepared GPU check: run it first on a machine with one CUDA GPU (under 8 minutes).

    python benchmarks/gpu_check.py                 # one CUDA GPU: writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --cpu --out F   # the same sections on this CPU, tiny models (CI smoke)

Sections, each recorded in the JSON as it ends (a section that fails is recorded with its
error and the others still run):
  env      the GPU (name, catalog type, memory), torch, CUDA, whether numba is compiled in;
  tests    the gpu-marked tests (pytest -m gpu tests/test_gpu.py);
  check    `heterog check --device cuda` for every zoo family (small configurations) under a
           1F1B pipeline and an uneven hybrid plan: every rank's stages built on the GPU and its
           computes run, peak memory per rank;
  steps    single-GPU training steps of resnet50, bert-large, gpt2-medium and a small Llama,
           fp32 and amp-bf16, two batch sizes each: a plain PyTorch loop beside heterog's
           executor on a one-device plan (the same step through the worker, in this process),
           so heterog's overhead (target: median ≤ 5 %), and heterog's prediction of step time
           and peak memory beside both;
  shared   a 2-stage GPT-2 pipeline and a 2-replica hybrid whose two ranks share the one GPU
           (NCCL refuses two ranks on one device: they talk through gloo with host copies,
           heterog.run(layout=DeviceLayout(share_gpus=True))), and tensor-parallel plans (GPT-2 at
           degree 2; Llama at degree 2 × two uneven ZeRO-1 replicas, 4 ranks), their parameters
           after 3 steps against single-process training.

`--sections tests,check,shared,steps` runs only those (env always). `--deadline-s S` (default
540): a case that would start after S seconds is skipped and listed under its section's
`skipped`, so the JSON comes back whole from a machine lent for minutes.
"""

from __future__ import annotations

import gc
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from heterog.jsonio import write_atomic

ROOT = Path(__file__).resolve().parent.parent
WARMUP, MEASURED = 3, 7
START = time.perf_counter()
DEADLINE_S = [540.0]  # set by --deadline-s


def past_deadline() -> bool:
    return time.perf_counter() - START > DEADLINE_S[0]


SEQ = 8
SMALL = {  # family → (zoo model, small args): the check's configurations
    "cnn": ("mobilenet_v2", dict(num_classes=10)),
    "seq2seq": ("transformer", dict(vocab=96, d_model=32, heads=4, layers=1, ffn=64, dropout=0.0)),
    "bert": ("bert-large", dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96, positions=32)),
    "xlnet": ("xlnet-large", dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96)),
    "gpt2": ("gpt2", dict(hidden=32, layers=2, heads=4, vocab=96, positions=32, dropout=0.0)),
    "llama": ("llama", dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=96, positions=32)),
}
_MODEL_CASES = [  # (model, args, batch sizes, seq len, optimizer)
    ("resnet50", {}, (16, 64), None, "sgd"),
    ("bert-large", {}, (4, 16), 512, "adamw"),
    ("gpt2-medium", {}, (4, 16), 512, "adamw"),
    ("llama", {}, (4, 16), 512, "adamw"),
]
# every model's first batch size before any second one, so a deadline leaves no model out
STEP_CASES = [(m, a, (bs[i],), s, o) for i in range(2) for m, a, bs, s, o in _MODEL_CASES]
CPU_STEP_CASES = [("toy-cnn", {}, (8,), None, "sgd"), ("gpt2", SMALL["gpt2"][1], (4,), SEQ, "adamw")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_node(gpu: str, n: int, cpu: bool) -> dict[str, Any]:
    """A cluster document of n devices on one node: the local GPU type, or CPU devices."""
    from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml

    if cpu:
        devices = ", ".join(f"{{type: cpu, name: box/cpu{i}}}" for i in range(n))
        return cluster_to_dict(
            parse_cluster_yaml(
                f"name: one-cpu\nkind: emulated\nnodes:\n  - name: box\n"
                f"    nic_bandwidth_gbps: 10\n    devices: [{devices}]\n"
            )
        )
    return cluster_to_dict(
        parse_cluster_yaml(
            f"name: one-gpu\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n"
            f"    devices: [{{type: {gpu}, count: {n}}}]\n"
        )
    )


def node_names(model: str, args: dict, seq_len: int | None) -> list[str]:
    from heterog.capture import capture_model

    return [n.name for n in capture_model(model, args or None, batch_size=2, seq_len=seq_len).nodes]


def split_plan(
    model: str,
    args: dict,
    kind: str,
    cluster: dict,
    *,
    batch: int = 6,
    seq_len: int | None = SEQ,
    optimizer: str = "sgd",
):
    """A 2-stage 1F1B pipeline ('pipeline') or an uneven hybrid ('hybrid': the front on one
    device, the back replicated 2/3 : 1/3) over the cluster's first devices."""
    from heterog.hardware.spec import cluster_from_dict
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    nodes = node_names(model, args, seq_len)
    k = len(nodes) // 2
    devs = [d.name for d in cluster_from_dict(cluster).devices]
    front, back = tuple(nodes[:k]), tuple(nodes[k:])
    if kind == "pipeline":
        groups = (
            Group(name="s0", nodes=front, replicas=(Replica(device=devs[0], share=1.0),)),
            Group(name="s1", nodes=back, replicas=(Replica(device=devs[1], share=1.0),)),
        )
    else:
        groups = (
            Group(name="front", nodes=front, replicas=(Replica(device=devs[0], share=1.0),)),
            Group(
                name="back",
                nodes=back,
                sync="ring",
                replicas=(Replica(device=devs[0], share=2 / 3), Replica(device=devs[1], share=1 / 3)),
            ),
        )
    return Plan(
        strategy=kind,
        model=ModelSpec(name=model, args=args, batch_size=batch, seq_len=seq_len),
        groups=groups,
        num_microbatches=2 if kind == "pipeline" else 1,
        schedule="1f1b" if kind == "pipeline" else "gpipe",
        optimizer=optimizer,
        cluster=cluster,
    ).validate()


def tp_plan(model: str, args: dict, cluster: dict, *, replicas: int = 1):
    """Tensor parallelism of degree 2 over the whole model: one set, or two sets whose
    replicas take uneven batch shares (0.6 / 0.4) with ZeRO-1 shards unlike them (0.3 / 0.7)."""
    from heterog.hardware.spec import cluster_from_dict
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    devs = [d.name for d in cluster_from_dict(cluster).devices]
    shares, shards = ((1.0,), (None,)) if replicas == 1 else ((0.6, 0.4), (0.3, 0.7))
    group = Group(
        name="all",
        nodes=tuple(node_names(model, args, SEQ)),
        sync="ring",
        shard_stage=0 if replicas == 1 else 1,
        replicas=tuple(
            Replica(device=devs[2 * i], share=share, shard=shard, tp_devices=(devs[2 * i + 1],))
            for i, (share, shard) in enumerate(zip(shares, shards))
        ),
    )
    return Plan(
        strategy="tensor-parallel",
        model=ModelSpec(name=model, args=args, batch_size=6, seq_len=SEQ),
        groups=(group,),
        num_microbatches=2,
        optimizer="sgd",
        cluster=cluster,
    ).validate()


# -- sections ------------------------------------------------------------------------------------------
def env_section(cpu: bool) -> dict[str, Any]:
    from heterog import _jit

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numba_compiled": _jit.COMPILED,
        "cpu_smoke": cpu,
    }
    if not cpu:
        from heterog.hardware.catalog import gpu_from_device_name

        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu_name=props.name,
            gpu_type=gpu_from_device_name(props.name, props.total_memory).name,
            gpu_memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            gpus=torch.cuda.device_count(),
        )
    return out


def tests_section(cpu: bool) -> dict[str, Any]:
    if cpu:
        return {"skipped": "the gpu-marked tests need a CUDA device"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = proc.stdout.strip().splitlines()[-15:]
    return {
        "exit_code": proc.returncode,
        "summary": tail[-1] if tail else "",
        "failures": [line for line in tail if line.startswith(("FAILED", "ERROR"))],
    }


def check_section(cpu: bool, gpu: str) -> dict[str, Any]:
    from heterog.execute.check import BuildCache
    from heterog.orchestrate import check

    cache = BuildCache()
    cluster = one_node(gpu, 2, cpu)
    families = {"gpt2": SMALL["gpt2"]} if cpu else SMALL
    rows, skipped = [], []
    for family, (model, args) in families.items():
        for kind in ("pipeline", "hybrid"):
            if past_deadline():
                skipped.append(f"{family} {kind}")
                continue
            seq = None if family == "cnn" else SEQ
            result = check(
                split_plan(model, args, kind, cluster, seq_len=seq), device="cpu" if cpu else "cuda", cache=cache
            )
            rows.append(
                {
                    "family": family,
                    "model": model,
                    "plan": kind,
                    "ok": result.ok,
                    "ranks": [r.to_dict() for r in result.ranks],
                }
            )
            print(f"check {family:8} {kind:8} {'ok' if result.ok else 'FAILED: ' + str(result.ranks)}", flush=True)
    return {"rows": rows, "skipped": skipped, "all_ok": all(r["ok"] for r in rows)}


def released(device: torch.device) -> int:
    """Free what earlier measurements left (collected objects, the allocator's cache) and
    return the bytes still allocated on the GPU: a peak measured next includes them."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def plain_step(
    model: str, args: dict, batch: int, seq_len: int | None, optimizer: str, precision: str, device: torch.device
) -> tuple[float, int]:
    """Median step time and peak memory of a plain PyTorch loop."""
    from heterog.execute.device import RankDevice
    from heterog.ir.plan import ModelSpec
    from heterog.workload import build_model, global_batch, make_optimizer, resolve_workload, to_device

    work = resolve_workload(ModelSpec(name=model, args=args, batch_size=batch, seq_len=seq_len))
    net = build_model(work, seed=0).to(device)
    opt = make_optimizer(list(net.parameters()), optimizer)
    rdev = RankDevice(kind=device.type, index=device.index or 0)
    rdev.activate()
    times = []
    for step in range(WARMUP + MEASURED):
        inputs, targets = to_device(global_batch(work, batch, seed=0, step=step), device)
        timer = rdev.timer()
        timer.start()
        opt.zero_grad(set_to_none=True)
        with rdev.autocast(precision):
            loss = work.loss(net(*inputs), targets)
        loss.float().backward()
        opt.step()
        times.append(timer.stop())
    memory = rdev.memory()["peak_allocated_bytes"]
    del net, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[WARMUP:]), memory


def heterog_step(plan, cpu: bool, models) -> tuple[float, int]:
    """Median step time and peak memory of heterog's executor carrying out the one-device
    plan's Program: the worker's own training loop, as one rank in this process."""
    from heterog.execute.spec import RankSpec
    from heterog.execute.worker import train
    from heterog.orchestrate import lower

    program = lower(plan)
    device = program.devices[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec = RankSpec(
            program=program.to_dict(),
            devices=(device,),
            steps=WARMUP + MEASURED,
            timeout_s=600,
            threads=torch.get_num_threads(),
            cuda=not cpu,
            cuda_indices=(0,),
            out_dir=tmp,
            gpu_types={} if cpu else {device: plan.cluster["nodes"][0]["devices"][0]["type"]},
            master_port=free_port(),
        )
        result = train(spec, Path(tmp), models=models)
    times = [s.step_time_s for s in result.steps]
    return statistics.median(times[WARMUP:]), result.peak_allocated_bytes


def steps_section(cpu: bool, gpu: str) -> dict[str, Any]:
    from heterog.cost.predict import predict
    from heterog.execute.worker import ModelCache
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    cluster = one_node(gpu, 1, cpu)
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    rows, skipped = [], []
    for model, args, batches, seq_len, optimizer in CPU_STEP_CASES if cpu else STEP_CASES:
        for batch in batches:
            for precision in ("fp32",) if cpu else ("fp32", "amp-bf16"):
                if past_deadline():
                    skipped.append(f"{model} b{batch} {precision}")
                    continue
                plan = Plan(
                    strategy="one-device",
                    model=ModelSpec(name=model, args=args, batch_size=batch, seq_len=seq_len),
                    groups=(
                        Group(
                            name="all",
                            nodes=tuple(node_names(model, args, seq_len)),
                            replicas=(Replica(device=cluster["nodes"][0]["devices"][0]["name"], share=1.0),),
                        ),
                    ),
                    optimizer=optimizer,
                    precision=precision,
                    cluster=cluster,
                ).validate()
                resident = released(device)
                t_plain, m_plain = plain_step(model, args, batch, seq_len, optimizer, precision, device)
                resident = max(resident, released(device))
                # a fresh model cache per case: a cached model stays on the GPU and would count in
                # the next case's peaks
                t_het, m_het = heterog_step(plan, cpu, ModelCache())
                pred = predict(
                    model,
                    model_args=args,
                    batch_size=batch,
                    seq_len=seq_len,
                    device="cpu" if cpu else gpu,
                    precision=precision,
                    optimizer=optimizer,
                )
                row = {
                    "model": model,
                    "batch_size": batch,
                    "precision": precision,
                    "optimizer": optimizer,
                    "plain_step_s": t_plain,
                    "heterog_step_s": t_het,
                    "overhead": t_het / t_plain - 1,
                    "resident_bytes_before": resident,  # allocated before the measurements began
                    "plain_peak_bytes": m_plain,
                    "heterog_peak_bytes": m_het,
                    "predicted_step_s": pred["iteration_time_s"],
                    "step_prediction_error": pred["iteration_time_s"] / t_plain - 1,
                    "predicted_peak_bytes": pred["peak_memory_bytes"],
                    "memory_prediction_error": pred["peak_memory_bytes"] / m_plain - 1 if m_plain else None,
                }
                rows.append(row)
                print(
                    f"step {model:>12} b{batch:<3} {precision:8} plain {t_plain * 1e3:8.2f} ms  heterog "
                    f"{t_het * 1e3:8.2f} ms ({row['overhead']:+.1%})  predicted {pred['iteration_time_s'] * 1e3:8.2f}"
                    f" ms ({row['step_prediction_error']:+.1%})  peak {m_plain / 2**20:8.1f} MiB, predicted "
                    f"{pred['peak_memory_bytes'] / 2**20:8.1f} MiB",
                    flush=True,
                )
    overheads = [r["overhead"] for r in rows]
    return {
        "rows": rows,
        "skipped": skipped,
        "median_overhead": statistics.median(overheads),
        "median_abs_step_prediction_error": statistics.median(abs(r["step_prediction_error"]) for r in rows),
        "median_abs_memory_prediction_error": statistics.median(
            abs(r["memory_prediction_error"]) for r in rows if r["memory_prediction_error"] is not None
        ),
    }


def shared_section(cpu: bool, gpu: str) -> dict[str, Any]:
    from heterog.ir.training_config import TrainingConfig

    model, args = SMALL["gpt2"]
    cases: list[tuple[str, Any, TrainingConfig]] = [
        (kind, split_plan(model, args, kind, one_node(gpu, 2, cpu), batch=6), TrainingConfig())
        for kind in (("pipeline",) if cpu else ("pipeline", "hybrid"))
    ]
    if not cpu:  # gradients clipped so that a slice counted twice in the global norm would show
        clip = TrainingConfig(max_grad_norm=0.5)
        cases.append(("gpt2 tp2", tp_plan(model, args, one_node(gpu, 2, cpu)), clip))
        llama, llama_args = SMALL["llama"]
        cases.append(("llama tp2 x zero1 dp2", tp_plan(llama, llama_args, one_node(gpu, 4, cpu), replicas=2), clip))
    rows, skipped = [], []
    for name, plan, training in cases:
        if past_deadline():
            skipped.append(name)
            continue
        rows.append(shared_row(name, plan, training))
        print(
            f"shared {name:22} backend {rows[-1]['backend']}  max relative difference "
            f"{rows[-1]['max_relative_difference']:.1e}",
            flush=True,
        )
    return {"rows": rows, "skipped": skipped, "all_equal": all(r["equal"] for r in rows)}


def shared_row(name: str, plan, training) -> dict[str, Any]:
    """Run `plan` for 3 steps with its ranks on the one GPU; every rank's parameters (made
    whole over a tensor-parallel set) against single-process training."""
    from heterog.execute.reference import reference_train
    from heterog.ir.run_request import DeviceLayout, Limits, OutputConfig, PredictionConfig
    from heterog.runs import run

    with tempfile.TemporaryDirectory() as tmp:
        out = run(
            plan,
            steps=3,
            output=OutputConfig(out_dir=tmp, dump_params=True),
            prediction=PredictionConfig(predict=False),
            limits=Limits(timeout_s=300),
            layout=DeviceLayout(share_gpus=True),
            training=training,
        )
        ref = reference_train(plan, steps=3, max_grad_norm=training.max_grad_norm)
        worst = 0.0
        for rank in range(len(out.devices)):
            for key, value in torch.load(Path(tmp) / f"params_rank{rank}.pt").items():
                worst = max(worst, ((value - ref[key]).norm() / ref[key].norm().clamp_min(1e-12)).item())
    return {
        "plan": name,
        "ranks": len(out.devices),
        "backend": out.per_rank[0].backend,
        "notes": list(out.notes),
        "max_relative_difference": worst,
        "equal": worst <= 1e-4,
        "measured_iteration_time_s": out.measured_iteration_time_s,
    }


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    if "--deadline-s" in argv:
        DEADLINE_S[0] = float(argv[argv.index("--deadline-s") + 1])
    out_path = Path(argv[argv.index("--out") + 1]) if "--out" in argv else ROOT / "benchmarks/results/gpu_check.json"
    if not cpu and not torch.cuda.is_available():
        print("no CUDA GPU visible: run this on a GPU machine, or with --cpu for the smoke version.", file=sys.stderr)
        return 2
    env = env_section(cpu)
    gpu = env.get("gpu_type", "cpu")
    doc: dict[str, Any] = {
        "benchmark": "gpu_check",
        "command": "python benchmarks/gpu_check.py" + (" --cpu" if cpu else ""),
        "sections": {"env": env},
    }
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("tests", lambda: tests_section(cpu)),
        ("check", lambda: check_section(cpu, gpu)),
        ("shared", lambda: shared_section(cpu, gpu)),
        ("steps", lambda: steps_section(cpu, gpu)),
    ]
    if "--sections" in argv:  # e.g. --sections steps: a later call for what an earlier one left
        wanted = argv[argv.index("--sections") + 1].split(",")
        sections = [(name, fn) for name, fn in sections if name in wanted]
    failed = False
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            doc["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - record the section's failure; the others still run
            failed = True
            doc["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
        doc["sections"][name]["time_s"] = time.perf_counter() - t0
        write_atomic(out_path, json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
