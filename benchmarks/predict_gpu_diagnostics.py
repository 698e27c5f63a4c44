"""Diagnostics behind docs/cost_model.md's explanations (no fitting; figures from the files).

--resnet-bf16  resnet50's fp32 step at batch 128 by kind of op (its per-op profile in
               h200_steps.json) and what its amp-bf16 steps at batch 128/256 allow
               (writes benchmarks/results/predict_gpu_resnet_bf16.json).
--peer-ops     each Aceso op of the peer per-layer data (peer_calibration.json `op_times`,
               forward) against the model's node for it in cost/peer_layer.py, with no per-type
               figures: the median ratio predicted / measured per type, precision, op and
               hidden size (writes benchmarks/results/predict_gpu_peer_ops.json). Needs the
               full peer file, not part of the repository: --peer-file PATH.

    .venv/bin/python benchmarks/predict_gpu_diagnostics.py --resnet-bf16 | --peer-ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from predict_gpu import (  # noqa: E402
    DEVICE,
    PEER_LAYER,
    PEER_TO_CATALOG,
    RESNET_KINDS,
    RESULT,
    graph_of,
    layer_precision,
    layer_records,
    resnet_kind_split_s,
    steps_doc,
)

from heterog.cost.analytic import AnalyticCostModel  # noqa: E402
from heterog.cost.predict import _captured, single_device_cluster  # noqa: E402
from heterog.hardware.catalog import get_gpu  # noqa: E402
from heterog.hardware.gputype import Efficiency  # noqa: E402
from heterog.ir.kinds import Phase  # noqa: E402
from heterog.jsonio import write_atomic  # noqa: E402

PROFILE_GROUPS = {
    "conv fwd": ("aten::_convolution",),
    "conv bwd": ("aten::convolution_backward",),
    "batch norm fwd": ("aten::cudnn_batch_norm",),
    "batch norm bwd": ("aten::cudnn_batch_norm_backward",),
    "element-wise": ("aten::add_", "aten::clamp_min_", "aten::threshold_backward"),
    "pool": ("aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward"),
}


def _model_steps_ms(g) -> dict:
    """The shipped catalog's H200 step time of resnet50 (SGD) at batch 128 and 256."""
    out = {}
    for precision in ("fp32", "amp-bf16"):
        m = AnalyticCostModel(g, single_device_cluster(get_gpu("H200")), precision=precision, optimizer="sgd")
        names = [n.name for n in g.nodes]
        for b in (128, 256):
            out[f"{b} {precision}"] = 1e3 * (
                m.group_time_s(names, DEVICE, b, Phase.FORWARD)
                + m.group_time_s(names, DEVICE, b, Phase.BACKWARD)
                + m.optimizer_time_s(names, DEVICE)
            )
    return out


def resnet_bf16_evidence() -> dict:
    """Decompose resnet50's fp32 step (batch 128, the per-op profile of h200_steps.json) by
    kind, and ask what the amp-bf16 steps at batch 128/256 allow: if the memory-bound ops
    moved half the bytes at their fp32 speed, how long would the convolutions have taken;
    if the convolutions ran 2× their TF32 speed (the tensor-core peak ratio), how long the
    memory-bound ops. Figures from the files only; the model is not involved but for the
    convolution FLOPs (the captured graph)."""
    doc = steps_doc()
    prof = next(p for p in doc["op_profiles"] if p["name"] == "resnet50")
    ms = {k: sum(o["device_us"] for o in prof["ops"] if o["op"] in ops) / 1e3 for k, ops in PROFILE_GROUPS.items()}
    device_ms = sum(o["self_device_us"] for o in prof["ops"]) / 1e3
    stem = next(o for o in prof["ops"] if o["op"] == "aten::cudnn_convolution" and o["shapes"].startswith("[[128, 3,"))
    step = {
        (s["batch_size"], s["mode"]): s["median_ms"]
        for s in doc["steps"]
        if s["name"] == "resnet50" and s["family"] == "cnn"
    }
    g = graph_of("resnet50", None)
    conv_fwd_flops = sum(n.fwd_flops.per_sample for n in g.nodes if n.kind == "conv") * prof["batch_size"]
    conv_ms = ms["conv fwd"] + ms["conv bwd"]
    mem_ms = device_ms - conv_ms
    host_ms = step[(128, "fp32")] - device_ms  # what the step adds to its kernels
    out = {
        "fp32_b128_device_ms_by_kind": ms,
        "fp32_b128_device_ms": device_ms,
        "fp32_b128_step_ms": step[(128, "fp32")],
        "stem_conv_child_ms": (stem["device_us"] - stem["self_device_us"]) / 1e3,
        "stem_conv_ms": stem["device_us"] / 1e3,
        "model_fp32_b128_ms_by_kind (shipped catalog)": dict(
            zip(RESNET_KINDS, resnet_kind_split_s(get_gpu("H200")) * 1e3)
        ),
        "model_step_ms (shipped catalog)": _model_steps_ms(g),
        "conv_fwd_tflops_fp32": conv_fwd_flops / (ms["conv fwd"] * 1e-3) / 1e12,
        "steps_ms": {f"{b} {m}": t for (b, m), t in sorted(step.items())},
    }
    for b in (128, 256):
        scale = b / prof["batch_size"]
        bf16_device = step[(b, "bf16")] - host_ms * scale
        out[f"b{b}"] = {
            "bf16_step_ms": step[(b, "bf16")],
            "fp32_step_ms": step[(b, "fp32")],
            "bf16_over_fp32": step[(b, "bf16")] / step[(b, "fp32")],
            "conv_ms_if_memory_ops_halve": bf16_device - mem_ms * scale / 2,
            "conv_ms_fp32": conv_ms * scale,
            "memory_ops_ms_if_convs_2x": bf16_device - conv_ms * scale / 2,
            "memory_ops_ms_fp32": mem_ms * scale,
        }
    return out


# Aceso's op names (peer_calibration.json op_times) and the node of cost/peer_layer.py for each
ACESO_OPS = {
    "enc-1st-layernorm": "ln_1",
    "enc-attention-qkv": "qkv",
    "enc-attention-score": "score",
    "enc-attention-softmax": "softmax",
    "enc-attention-dropout": "attn_dropout",
    "enc-attention-context": "context",
    "enc-attention-dense": "dense",
    "enc-post-attention-dropout": "attn_residual",
    "enc-2nd-layernorm": "ln_2",
    "enc-MLP-GEMM-1": "fc_1",
    "enc-MLP-gelu": "gelu",
    "enc-MLP-GEMM-2": "fc_2",
    "enc-post-MLP-dropout": "mlp_residual",
}


def peer_ops(peer_file: Path) -> dict:
    """Median predicted / measured forward time of each Aceso op, by type, precision, op and
    hidden size, with the H200 rule alone (no per-type figures, no harness floor)."""
    table = json.loads(peer_file.read_text())["op_times"]
    shapes = {(r["gpu"], r["model"], r["dtype"]): r for r in layer_records() if r["source"].startswith("aceso")}
    models: dict[tuple, AnalyticCostModel] = {}
    ratios: dict[tuple, list[float]] = defaultdict(list)
    for row in table["rows"]:
        r = dict(zip(table["columns"], row))
        lr = shapes.get((r["gpu"], r["model"], r["dtype"]))
        if r["tp"] != 1 or r["op"] not in ACESO_OPS or r["fwd_ms"] is None or lr is None:
            continue
        name, prec = PEER_TO_CATALOG[r["gpu"]], layer_precision(lr)
        # fp32 layers: the softmax also as if fused (one kernel), to show what the fallback adds
        for fused in {prec == "fp16", True}:
            key = (name, lr["hidden"], lr["heads"], lr["ffn"], prec, fused)
            if key not in models:
                g = _captured(
                    f"{PEER_LAYER}:megatron_gpt_layer",
                    {
                        "hidden": lr["hidden"],
                        "heads": lr["heads"],
                        "ffn": lr["ffn"],
                        "layers": 1,
                        "fused_softmax": fused,
                    },
                    1,
                    lr["seq_len"],
                )
                gpu = dataclasses.replace(get_gpu(name), efficiency=Efficiency())
                models[key] = AnalyticCostModel(g, single_device_cluster(gpu), precision=prec, optimizer="adamw")
            t = models[key].group_time_s(["layers.0." + ACESO_OPS[r["op"]]], DEVICE, r["micro_batch"], Phase.FORWARD)
            ratios[(name, prec, r["op"], lr["hidden"], fused == (prec == "fp16"))].append(t / (r["fwd_ms"] * 1e-3))
    rows = [
        {
            "gpu": k[0],
            "precision": k[1],
            "op": k[2],
            "hidden": k[3],
            "cases": len(v),
            "median_predicted_over_measured": statistics.median(v),
            **(
                {}
                if k[1] == "fp16" or k[2] != "enc-attention-softmax"
                else {"with_one_fused_softmax": statistics.median(ratios[(*k[:4], False)])}
            ),
        }
        for k, v in sorted(ratios.items())
        if k[4]
    ]
    for r in rows:
        print(
            f"{r['gpu']:11s} {r['precision']:5s} {r['op']:27s} h{r['hidden']:<5d} "
            f"{r['median_predicted_over_measured']:.2f}"
            + (f" (one fused kernel: {r['with_one_fused_softmax']:.2f})" if "with_one_fused_softmax" in r else "")
        )
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resnet-bf16", action="store_true")
    ap.add_argument("--peer-ops", action="store_true")
    ap.add_argument(
        "--peer-file", type=Path, help="peer_calibration.json (eth-easl/sailor at cf2c8e3c), for --peer-ops"
    )
    args = ap.parse_args()
    if args.resnet_bf16:
        ev = resnet_bf16_evidence()
        print(json.dumps(ev, indent=1))
        write_atomic(
            RESULT.with_name("predict_gpu_resnet_bf16.json"),
            json.dumps({"command": "benchmarks/predict_gpu_diagnostics.py --resnet-bf16", **ev}, indent=1),
        )
    if args.peer_ops:
        if args.peer_file is None:
            ap.error("--peer-ops needs --peer-file PATH")
        doc = {"command": "benchmarks/predict_gpu_diagnostics.py --peer-ops", **peer_ops(args.peer_file)}
        write_atomic(RESULT.with_name("predict_gpu_peer_ops.json"), json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
