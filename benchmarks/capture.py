"""Capture time and peak memory for every zoo model and a 7B Llama, each in a fresh process.

    .venv/bin/python benchmarks/capture.py [--models a,b,...]

Each capture runs in its own subprocess so its peak RSS (getrusage ru_maxrss, which
includes the ~0.3-0.4 GB of importing torch and transformers) is not inflated by earlier
ones. Targets: the 7B model in under 30 s and 2 GiB — no parameter memory is
allocated (7B fp32 parameters alone would be 28 GB). Writes benchmarks/results/capture.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_7B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "ffn": 11008, "vocab": 32000}

_CHILD = r"""
import json, resource, sys, time
import psutil
t0 = time.perf_counter()
from heterog.capture import capture_model
from heterog.capture.zoo import get_zoo_model
t1 = time.perf_counter()
name, args, batch, seq = json.loads(sys.argv[1])
graph = capture_model(name, args, batch_size=batch, seq_len=seq)
t2 = time.perf_counter()
print(json.dumps({
    "import_time_s": t1 - t0, "capture_time_s": t2 - t1,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_after_bytes": psutil.Process().memory_info().rss,
    "num_nodes": len(graph.nodes), "num_edges": len(graph.edges),
    "num_parameters": graph.num_parameters, "batch_size": graph.batch_size, "seq_len": graph.seq_len,
    "forward_flops": graph.forward_flops(), "backward_flops": graph.backward_flops(),
    "saved_activation_bytes": graph.saved_activation_bytes(),
}))
"""


def cases(selected: list[str] | None) -> list[tuple[str, str, dict, int, int | None]]:
    sys.path.insert(0, str(ROOT / "src"))
    from heterog.capture.zoo import ZOO

    out = []
    for name, entry in ZOO.items():
        out.append((name, name, {}, entry.default_batch_size, entry.default_seq_len))
    out.append(("llama-7b", "llama", LLAMA_7B, 8, 2048))
    if selected:
        out = [c for c in out if c[0] in selected]
    return out


def run_one(model: str, args: dict, batch: int, seq: int | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([model, args, batch, seq])],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_time_s"] = time.perf_counter() - started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated subset (names as in the table)")
    opts = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from heterog.cli.output import print_table
    from heterog.fmt import human_bytes, human_flops
    from heterog.jsonio import write_atomic

    results = []
    for label, model, args, batch, seq in cases(opts.models.split(",") if opts.models else None):
        row = {"name": label, "model": model, "model_args": args, **run_one(model, args, batch, seq)}
        results.append(row)
        print(
            f"{label}: "
            + (
                row["error"]
                if "error" in row
                else f"{row['capture_time_s']:.1f} s, {human_bytes(row['peak_rss_bytes'])}"
            ),
            flush=True,
        )
    rows = [
        [
            r["name"],
            f"{r.get('num_parameters', 0):,}",
            r.get("batch_size", "—"),
            r.get("seq_len") or "—",
            r.get("num_nodes", "—"),
            human_flops(r.get("forward_flops", 0)),
            f"{r['capture_time_s']:.1f}" if "capture_time_s" in r else r.get("error", ""),
            human_bytes(r["peak_rss_bytes"]) if "peak_rss_bytes" in r else "—",
        ]
        for r in results
    ]
    print_table(
        "capture: time and peak RSS per model (fresh process each)",
        ["model", "parameters", "batch", "seq", "nodes", "forward", "capture s", "peak RSS"],
        rows,
    )
    seven = next((r for r in results if r["name"] == "llama-7b" and "capture_time_s" in r), None)
    summary = {}
    if seven:
        summary = {
            "llama_7b_capture_time_s": seven["capture_time_s"],
            "llama_7b_peak_rss_bytes": seven["peak_rss_bytes"],
            "llama_7b_meets_target": seven["capture_time_s"] < 30 and seven["peak_rss_bytes"] < 2 * 2**30,
        }
        print(
            f"7B llama: {seven['capture_time_s']:.1f} s, peak RSS {human_bytes(seven['peak_rss_bytes'])} "
            f"(target < 30 s and < 2 GiB: {'met' if summary['llama_7b_meets_target'] else 'NOT met'})"
        )
    doc = {
        "benchmark": "capture",
        "command": "python benchmarks/capture.py",
        "cpu_count": os.cpu_count(),
        "results": results,
        "summary": summary,
    }
    write_atomic(ROOT / "benchmarks" / "results" / "capture.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
