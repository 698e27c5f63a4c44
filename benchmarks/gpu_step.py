"""heterog's single-GPU run against a plain PyTorch training loop, and heterog's prediction.

For resnet50, gpt2-medium and a small Llama at two batch sizes each: the median step time
(CUDA events, 10 steps after 3 warm-up) and peak memory (torch.cuda.max_memory_allocated) of
  plain     the model's own forward, loss, backward and optimizer step in one process;
  heterog   the same step as heterog runs it: a one-device plan lowered to a Program and
            carried out by the executor (heterog.pipeline.run);
and `heterog predict` for the same step. Targets: heterog within 3% of plain in time
and 5% in memory. Writes benchmarks/results/gpu_step_<gpu>.json.

    python benchmarks/gpu_step.py            # on a machine with a CUDA GPU
    python benchmarks/gpu_step.py --cpu      # the same code path on this CPU, tiny models (smoke)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from heterog.jsonio import write_atomic

CASES = [  # (model, model args, batch sizes, seq len, optimizer, precision)
    ("resnet50", {}, (8, 64), None, "sgd", "fp32"),
    ("gpt2-medium", {}, (2, 8), 512, "adamw", "amp-bf16"),
    ("llama", {}, (4, 16), 512, "adamw", "amp-bf16"),
]
CPU_CASES = [("toy-cnn", {}, (8, 32), None, "sgd", "fp32"), ("mlp", {}, (16, 64), None, "adamw", "amp-bf16")]
WARMUP, MEASURED = 3, 10


def plain_step(model_name, args, batch, seq_len, optimizer, precision, device):
    """Median step time and peak memory of a plain PyTorch loop."""
    from heterog.execute.device import RankDevice
    from heterog.execute.workload import build_model, global_batch, make_optimizer, resolve_workload, to_device
    from heterog.ir.plan import ModelSpec
    work = resolve_workload(ModelSpec(name=model_name, args=args, batch_size=batch, seq_len=seq_len))
    model = build_model(work, seed=0).to(device)
    opt = make_optimizer(list(model.parameters()), optimizer)
    rdev = RankDevice(kind=device.type, index=device.index or 0)
    rdev.activate()
    times = []
    for step in range(WARMUP + MEASURED):
        inputs, targets = to_device(global_batch(work, batch, seed=0, step=step), device)
        timer = rdev.timer()
        timer.start()
        opt.zero_grad(set_to_none=True)
        with rdev.autocast(precision):
            loss = work.loss(model(*inputs), targets)
        loss.float().backward()
        opt.step()
        t = timer.stop()
        if step >= WARMUP:
            times.append(t)
    return statistics.median(times), rdev.memory()["peak_allocated_bytes"]


def heterog_step(model_name, args, batch, seq_len, optimizer, precision, cluster, device_name, tmp):
    """Median step time and peak memory of heterog's executor on a one-device plan."""
    from heterog.capture import capture_model
    from heterog.hardware.spec import cluster_to_dict
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica
    from heterog.pipeline import run
    graph = capture_model(model_name, args or None, batch_size=batch, seq_len=seq_len)
    plan = Plan(strategy="single-device", model=ModelSpec(name=model_name, args=args, batch_size=batch,
                                                          seq_len=seq_len),
                groups=(Group(name="all", nodes=tuple(n.name for n in graph.nodes),
                              replicas=(Replica(device=device_name, share=1.0),)),),
                optimizer=optimizer, precision=precision, cluster=cluster_to_dict(cluster)).validate()
    out = run(plan, steps=WARMUP + MEASURED, warmup_steps=WARMUP, out_dir=tmp, timeout_s=600)
    r = out["per_rank"][0]
    return out["measured_iteration_time_s"], r["peak_allocated_bytes"], out["predicted_iteration_time_s"]


def main() -> None:
    import tempfile

    from heterog.cost.predict import predict
    from heterog.hardware.spec import parse_cluster_yaml
    cpu = "--cpu" in sys.argv
    if not cpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU visible: run this on a GPU machine (or --cpu for the smoke version).")
    if cpu:       # the ranks run one thread each: so does the plain loop (times are a smoke check only)
        torch.set_num_threads(1)
        gpu, device, cases = "cpu", torch.device("cpu"), CPU_CASES
        cluster = parse_cluster_yaml("name: one-cpu\nkind: emulated\nnodes:\n  - name: box\n"
                                     "    nic_bandwidth_gbps: 10\n    devices: [{type: cpu, name: box/cpu0}]\n")
    else:
        from heterog.hardware.catalog import gpu_from_device_name
        props = torch.cuda.get_device_properties(0)
        gpu, device, cases = gpu_from_device_name(props.name, props.total_memory).name, torch.device("cuda", 0), CASES
        cluster = parse_cluster_yaml(f"name: one-gpu\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n"
                                     f"    devices: [{{type: {gpu}, name: box/gpu0}}]\n")
    device_name = cluster.devices[0].name
    rows = []
    for model_name, args, batches, seq_len, optimizer, precision in cases:
        for batch in batches:
            t_plain, m_plain = plain_step(model_name, args, batch, seq_len, optimizer, precision, device)
            with tempfile.TemporaryDirectory() as tmp:
                t_het, m_het, t_sim = heterog_step(model_name, args, batch, seq_len, optimizer, precision,
                                                   cluster, device_name, tmp)
            pred = predict(model_name, model_args=args, batch_size=batch, seq_len=seq_len, device=gpu,
                           precision=precision, optimizer=optimizer)
            row = {"model": model_name, "batch_size": batch, "precision": precision, "optimizer": optimizer,
                   "plain_step_s": t_plain, "heterog_step_s": t_het,
                   "time_ratio": t_het / t_plain, "plain_peak_bytes": m_plain, "heterog_peak_bytes": m_het,
                   "memory_ratio": m_het / m_plain if m_plain else None,
                   "predicted_step_s": pred["iteration_time_s"], "simulated_step_s": t_sim,
                   "prediction_error": pred["iteration_time_s"] / t_plain - 1,
                   "predicted_peak_bytes": pred["peak_memory_bytes"],
                   "memory_prediction_error": pred["peak_memory_bytes"] / m_plain - 1 if m_plain else None}
            rows.append(row)
            print(f"{model_name:>12} b{batch:<4} {precision:8}  plain {t_plain * 1e3:8.2f} ms  heterog "
                  f"{t_het * 1e3:8.2f} ms ({row['time_ratio'] - 1:+.1%})  memory {m_het / 2**20:8.1f} MiB "
                  f"({(row['memory_ratio'] or 1) - 1:+.1%})  predicted {pred['iteration_time_s'] * 1e3:8.2f} ms "
                  f"({row['prediction_error']:+.1%})", flush=True)
    if cpu:
        print("(--cpu: a smoke check of the code path on a shared CPU; nothing written)")
        return
    out = Path(__file__).parent / "results" / f"gpu_step_{gpu}.json"
    write_atomic(out, json.dumps({"benchmark": "gpu_step", "gpu": gpu, "torch": torch.__version__,
                                  "command": "python benchmarks/gpu_step.py" + (" --cpu" if cpu else ""),
                                  "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
