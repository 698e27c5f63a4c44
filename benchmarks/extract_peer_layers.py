"""Extract the per-layer subset of the shared peer measurements that heterog calibrates on.

Source: the peer calibration file compiled from eth-easl/sailor at cf2c8e3c (with the Aceso
profiler data it carries), given as --source; it is not part of the repository. Kept: the `transformer_layer` records
at tensor-parallel degree 1 (the fields a per-layer prediction needs) and the `gpus` table.
Nothing from the held-out sources (Zorse/Cephalo model_latencies.json, AMP's or Sailor's
validation runs) is in that file or here.

    .venv/bin/python benchmarks/extract_peer_layers.py --source PATH
writes src/heterog/cost/data/peer_layers.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from heterog.jsonio import write_atomic  # noqa: E402

OUT = ROOT / "src" / "heterog" / "cost" / "data" / "peer_layers.json"
FIELDS = (
    "gpu",
    "model",
    "source",
    "hidden",
    "heads",
    "ffn",
    "ffn_type",
    "seq_len",
    "vocab",
    "micro_batch",
    "dtype",
    "math_mode_inferred",
    "fwd_ms",
    "bwd_ms",
    "flags",
    "path",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="peer_calibration.json (eth-easl/sailor at cf2c8e3c)")
    args = ap.parse_args()
    doc = json.loads(Path(args.source).read_text())
    layers = [
        {k: r.get(k) for k in FIELDS}
        for r in doc["layer_times"]
        if r["part"] == "transformer_layer"
        and r.get("tp") == 1
        and r.get("fwd_ms") is not None
        and r.get("bwd_ms") is not None
    ]
    out = {
        "about": "Per-layer transformer times (tp = 1) extracted by benchmarks/extract_peer_layers.py "
        "from the peer calibration file (eth-easl/sailor at cf2c8e3c): " + doc["about"],
        "flop_formula": doc.get("flop_formula"),
        "gpus": doc["gpus"],
        "layer_times": layers,
    }
    write_atomic(OUT, json.dumps(out, indent=0, sort_keys=True))
    print(f"{len(layers)} layer records → {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
