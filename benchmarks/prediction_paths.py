"""Why `heterog simulate` and `heterog run` predict different times for one emulated plan.

One plan (toy-cnn, batch 48, on emulated-4, seed 0, 20 search moves) is simulated four ways,
each in a fresh process so no probe or cache carries over unless the case says so:

  simulate      the plan's stored cluster, at torch's default thread count (`heterog simulate`)
  run           `local_cluster`: the `cpu` type re-probed at one thread (`heterog run`'s prediction)
  run→simulate  the run's path, then the simulate path in the same process
  simulate→run  the simulate path, then the run's path in the same process

    .venv/bin/python benchmarks/prediction_paths.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from heterog.jsonio import write_atomic

CASE = r'''
import json, sys
from pathlib import Path
from heterog.cli.simulate_cmd import load_inputs
from heterog.cost import build_cost_model
from heterog.pipeline import local_cluster
from heterog.simulate import simulate
import torch
plan, g, c, costs = load_inputs(Path(sys.argv[1]), None, None)
out = {"threads_at_start": torch.get_num_threads()}
for step in sys.argv[2].split(","):
    clu = c if step == "simulate" else local_cluster(c)
    r = simulate(g, clu, plan, build_cost_model(g, clu, precision=plan.precision, optimizer=plan.optimizer))
    out[step] = {"iteration_time_s": r.iteration_time_s, "threads": torch.get_num_threads(),
                 "cpu_fp32_peak_flops_per_s": clu.gpu_types["cpu"].peak_flops_per_s["fp32"]}
print(json.dumps(out))
'''


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        subprocess.run([sys.executable, "-m", "heterog.cli.main", "plan", "--model", "toy-cnn", "--batch-size", "48",
                        "--cluster", "emulated-4", "--budget-s", "2", "--max-iters", "20", "--no-gnn",
                        "--out", str(plan)], check=True, capture_output=True)
        recorded = json.loads(plan.read_text())["predicted_iteration_time_s"]
        cases = {}
        for name, steps in (("simulate", "simulate"), ("run", "run"), ("run→simulate", "run,simulate"),
                            ("simulate→run", "simulate,run")):
            res = subprocess.run([sys.executable, "-c", CASE, str(plan), steps], check=True, capture_output=True,
                                 text=True)
            cases[name] = json.loads(res.stdout.strip().splitlines()[-1])
            print(name, json.dumps(cases[name]))
    out = Path(__file__).parent / "results" / "prediction_paths.json"
    write_atomic(out, json.dumps({"command": "python benchmarks/prediction_paths.py",
                                  "plan_recorded_iteration_time_s": recorded, "cases": cases}, indent=1) + "\n")
    print(f"plan recorded {recorded * 1e3:.2f} ms; wrote {out}")


if __name__ == "__main__":
    main()
