"""The predicted iteration time each command prints for one saved plan: one number, or a bug.

For a plan on an emulated cluster (toy-cnn on emulated-4) and one on a GPU cluster (toy-cnn on
paper-8gpu, run emulated), each command runs in its own process, as a user runs them:
`heterog plan --out`, `heterog simulate`, `heterog report`, `heterog run` (2 steps; the GPU
cluster's plan with --emulated) and the Python API's `heterog.simulate(path)`. They all build
the plan's inputs through heterog/inputs.py, so every column should hold the same time.

    python benchmarks/one_prediction.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from heterog.jsonio import write_atomic

CASES = (("toy-cnn", 32, "emulated-4", []), ("toy-cnn", 256, "paper-8gpu", ["--emulated"]))


def heterog(*args: str, cwd: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "heterog.cli.main", *args, "--json"],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return json.loads(out.stdout)


def case(model: str, batch: int, cluster: str, run_flags: list[str], folder: Path) -> dict:
    planned = heterog(
        "plan",
        "--model",
        model,
        "--batch-size",
        str(batch),
        "--cluster",
        cluster,
        "--budget-s",
        "3",
        "--max-iters",
        "40",
        "--seed",
        "0",
        "--no-gnn",
        "--out",
        "plan.json",
        cwd=folder,
    )
    api = subprocess.run(
        [sys.executable, "-c", "import heterog; print(heterog.simulate('plan.json').iteration_time_s)"],
        cwd=folder,
        check=True,
        capture_output=True,
        text=True,
    )
    predicted = {
        "heterog plan": planned["best"]["predicted_iteration_time_s"],
        "heterog simulate plan.json": heterog("simulate", "plan.json", cwd=folder)["iteration_time_s"],
        "heterog report plan.json": heterog("report", "plan.json", "--out", "report.html", cwd=folder)[
            "iteration_time_s"
        ],
        "heterog run plan.json": heterog("run", "plan.json", "--steps", "2", *run_flags, cwd=folder)[
            "predicted_iteration_time_s"
        ],
        "heterog.simulate('plan.json')": float(api.stdout.strip().splitlines()[-1]),
    }
    return {
        "model": model,
        "batch_size": batch,
        "cluster": cluster,
        "strategy": planned["best"]["strategy"],
        "run_flags": run_flags,
        "predicted_s": predicted,
        "all_equal": len({round(t, 12) for t in predicted.values()}) == 1,
    }


def main() -> None:
    cases = []
    for model, batch, cluster, flags in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            cases.append(case(model, batch, cluster, flags, Path(tmp)))
        print(json.dumps(cases[-1]), flush=True)
    out = Path(__file__).parent / "results" / "one_prediction.json"
    write_atomic(out, json.dumps({"command": "python benchmarks/one_prediction.py", "cases": cases}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
