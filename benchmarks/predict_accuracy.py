"""How well `heterog predict` matches real single-device training steps.

For each configuration (a zoo model at a small size), a fresh subprocess builds the model,
runs warm-up steps (SGD with momentum or AdamW: zero_grad → forward → loss → backward →
step), then times further steps (median) and measures the peak memory of one steady-state
step. The parent process predicts the same step with heterog.cost.predict.predict and
reports the absolute percentage errors (median and worst).

Memory, CPU: the peak bytes of live tensors during one step, from PyTorch's own tracker
(torch.distributed._tools.mem_tracker.MemTracker, which follows every storage allocated
and freed), the same quantity as torch.cuda.max_memory_allocated on a GPU. The process's
resident-set growth over one step (peak RSS after resetting it through
/proc/self/clear_refs, minus the RSS before the model was built) is recorded beside it; it
also holds the allocator's cached free memory and the libraries' buffers.
Memory, CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats.

    .venv/bin/python benchmarks/predict_accuracy.py            # this machine's CPU (or GPU)
    .venv/bin/python benchmarks/predict_accuracy.py --quick    # three small configurations
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "predict_accuracy.json"

# (label, zoo model, model args, batch size, seq_len, optimizer)
CONFIGS = [
    ("mlp-512x4", "mlp", {"in_features": 512, "hidden": 512, "layers": 4}, 64, None, "sgd"),
    ("toy-cnn-w32", "toy-cnn", {"width": 32}, 32, None, "sgd"),
    ("toy-cnn-w32-adamw", "toy-cnn", {"width": 32}, 32, None, "adamw"),
    ("resnet50-b4", "resnet50", {}, 4, None, "sgd"),
    ("mobilenet_v2-b8", "mobilenet_v2", {}, 8, None, "sgd"),
    ("gpt2-2L-256", "gpt2", {"hidden": 256, "layers": 2, "heads": 4}, 4, 128, "adamw"),
    ("llama-2L-256", "llama", {"hidden": 256, "layers": 2, "heads": 4}, 4, 128, "adamw"),
    ("bert-2L-256", "bert-large", {"hidden": 256, "layers": 2, "heads": 4, "ffn": 1024}, 4, 128, "sgd"),
]
QUICK = ["mlp-512x4", "toy-cnn-w32", "gpt2-2L-256"]


# -- the measuring subprocess -------------------------------------------------------------------


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(cfg: dict) -> dict:
    import torch

    from heterog.capture.zoo import get_zoo_model

    dev = torch.device(cfg["device"])
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    # x86 CPUs slow down ~100x on denormal floats, which AdamW's tiny second moments produce;
    # GPUs flush them at full speed, and the cost model does not model the penalty.
    torch.set_flush_denormal(True)
    rss_before = _rss_bytes("VmRSS")
    zm = get_zoo_model(cfg["model"])
    torch.manual_seed(0)
    model = zm.build(**cfg["args"]).to(dev).train()
    inputs, targets = zm.example_batch(cfg["batch_size"], cfg["seq_len"], device=dev, **cfg["args"])
    if cfg["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    import contextlib

    amp = cfg.get("precision", "fp32") == "amp-bf16"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        # amp-bf16 as heterog means it: autocast around forward and loss, fp32 master weights
        with torch.autocast(dev.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            loss = zm.loss(model(*inputs), targets)
        loss.backward()
        opt.step()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(cfg["warmup"]):
        step()
    sync()
    times, cpu_times = [], []
    deadline = time.perf_counter() + cfg["max_time_s"]
    while len(times) < cfg["steps"] and (len(times) < 3 or time.perf_counter() < deadline):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        sync()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
    out = {
        "step_times_s": times,
        "wall_time_s": statistics.median(times),
        "thread_cpu_time_s": statistics.median(cpu_times),
        "threads": torch.get_num_threads(),
    }
    # With one thread on a shared CPU, the thread's own CPU time is the step time the
    # process would see alone; wall time also counts the waits for other processes.
    use_cpu = cfg.get("clock") == "thread" and dev.type == "cpu"
    out["time_s"] = out["thread_cpu_time_s"] if use_cpu else out["wall_time_s"]
    out["clock"] = "thread_cpu" if use_cpu else "wall"
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        out["memory_method"] = "torch.cuda.max_memory_allocated"
        out["device_name"] = torch.cuda.get_device_name()
        return out
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter
        step()
        out["rss_growth_bytes"] = _rss_bytes("VmHWM") - rss_before
    except OSError:
        out["rss_growth_bytes"] = None
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step()
    peak = mt.get_tracker_snapshot("peak")
    out["peak_memory_bytes"] = int(sum(v.get("Total", 0) for v in peak.values()))
    out["memory_method"] = "MemTracker peak of live tensor storage"
    return out


# -- the driver --------------------------------------------------------------------------------------


def _catalog_type() -> str:
    """The catalog type of this machine's GPU (torch.cuda.get_device_name + its memory)."""
    import torch

    from heterog.hardware.catalog import gpu_from_device_name

    props = torch.cuda.get_device_properties(0)
    return gpu_from_device_name(props.name, props.total_memory).name


def measure(cfg: dict) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg['label']}: worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pct_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured * 100.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    ap.add_argument("--only", nargs="*", help="labels to run")
    ap.add_argument("--device", default=None, help="'cpu' or 'cuda' (default: cuda if available)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "amp-bf16"], default="fp32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="'thread': the worker thread's CPU time (needs --threads 1; for a loaded machine)",
    )
    ap.add_argument(
        "--cached-probe",
        action="store_true",
        help="use the cached CPU probe instead of measuring it again now, under today's load",
    )
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    import torch

    from heterog.cli.output import print_table, write_json
    from heterog.cost.predict import predict

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.clock == "thread" and args.threads != 1:
        raise SystemExit("--clock thread measures one thread's CPU time: add --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device == "cpu" and not args.cached_probe:
        import tempfile

        from heterog.hardware import cpu_probe, efficiency

        os.environ["HETEROG_CACHE_DIR"] = tempfile.mkdtemp(prefix="heterog-probe-")
        cpu_probe._measure_cpu_for.cache_clear()
        efficiency.cpu_curve.cache_clear()
    catalog_type = _catalog_type() if device == "cuda" else "cpu"
    chosen = [c for c in CONFIGS if (not args.quick or c[0] in QUICK) and (not args.only or c[0] in args.only)]
    load_before = os.getloadavg()
    rows, records = [], []
    for label, model, margs, bs, seq, optim in chosen:
        cfg = {
            "label": label,
            "model": model,
            "args": margs,
            "batch_size": bs,
            "seq_len": seq,
            "optimizer": optim,
            "device": device,
            "steps": args.steps,
            "warmup": args.warmup,
            "max_time_s": 20.0,
            "threads": args.threads,
            "precision": args.precision,
            "clock": args.clock,
        }
        m = measure(cfg)
        p = predict(
            model,
            model_args=margs,
            batch_size=bs,
            seq_len=seq,
            device=catalog_type,
            optimizer=optim,
            precision=args.precision,
        )
        rec = {
            "label": label,
            "model": model,
            "model_args": margs,
            "batch_size": bs,
            "seq_len": seq,
            "optimizer": optim,
            "measured": m,
            "predicted": {k: p[k] for k in ("iteration_time_s", "peak_memory_bytes", "flops_per_iteration", "fits")}
            | {"breakdown": p["breakdown"]},
            "time_error_pct": pct_error(p["iteration_time_s"], m["time_s"]),
            "memory_error_pct": pct_error(p["peak_memory_bytes"], m["peak_memory_bytes"]),
        }
        records.append(rec)
        rows.append(
            (
                label,
                f"{m['time_s'] * 1e3:.1f}",
                f"{p['iteration_time_s'] * 1e3:.1f}",
                f"{rec['time_error_pct']:.1f}",
                f"{m['peak_memory_bytes'] / 2**20:.1f}",
                f"{p['peak_memory_bytes'] / 2**20:.1f}",
                f"{rec['memory_error_pct']:.1f}",
                f"{(m.get('rss_growth_bytes') or 0) / 2**20:.0f}",
            )
        )
    t_err = [r["time_error_pct"] for r in records]
    m_err = [r["memory_error_pct"] for r in records]
    summary = {
        "device": device,
        "catalog_type": catalog_type,
        "precision": args.precision,
        "time_error_pct": {"median": statistics.median(t_err), "worst": max(t_err)},
        "memory_error_pct": {"median": statistics.median(m_err), "worst": max(m_err)},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "clock": args.clock,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "benchmarks/predict_accuracy.py " + " ".join(sys.argv[1:]),
    }
    print_table(
        f"predict vs measured on {catalog_type} (load {load_before[0]:.2f} → {os.getloadavg()[0]:.2f})",
        ["config", "meas ms", "pred ms", "time err %", "meas MiB", "pred MiB", "mem err %", "RSS+ MiB"],
        rows,
    )
    print(
        f"time error: median {summary['time_error_pct']['median']:.1f}%, worst "
        f"{summary['time_error_pct']['worst']:.1f}%; memory error: median "
        f"{summary['memory_error_pct']['median']:.1f}%, worst {summary['memory_error_pct']['worst']:.1f}%"
    )
    write_json(
        args.out,
        {"summary": summary, "configs": records, "method": __doc__.split("\n\n")[1] + " " + __doc__.split("\n\n")[2]},
    )


if __name__ == "__main__":
    main()
