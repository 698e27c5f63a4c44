"""Resume after a fault, on the same plan and on one device fewer: how close to an
uninterrupted run, and what it costs.

    .venv/bin/python benchmarks/resume_after_fault.py

The scenario of tests/test_checkpoint_resume.py, with the figures kept: a 10-step AdamW run
of the tests' MLP on 3 local gloo ranks with checkpoints every 2 steps; rank 1 is killed in
the middle of step 5; the run resumes from the last complete checkpoint (4 steps) under the
same plan and under a plan for 2 devices (same global batch). Reports the largest relative
parameter difference to the uninterrupted run, each run's wall time, the checkpoint size and
the ranks' peak resident memory. Writes benchmarks/results/resume_after_fault.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_checkpoint_resume import STEPS, _params, three_device_plan, two_device_plan  # noqa: E402

from heterog.errors import RankError  # noqa: E402
from heterog.ir.run_request import (  # noqa: E402
    CheckpointConfig,
    Fault,
    FaultKind,
    FaultPhase,
    Limits,
    OutputConfig,
    PredictionConfig,
)
from heterog.ir.run_result import RunResult  # noqa: E402
from heterog.runs import run  # noqa: E402


def _max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(((got[n] - w).norm() / w.norm().clamp_min(1e-12)).item() for n, w in want.items())


def _timed(plan, **kw) -> tuple[RunResult | None, float]:
    t0 = time.perf_counter()
    try:
        out = run(plan, prediction=PredictionConfig(predict=False), **kw)
    except RankError:
        out = None
    return out, time.perf_counter() - t0


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    ckpt = root / "ckpt"
    full, full_s = _timed(
        three_device_plan(),
        steps=STEPS,
        output=OutputConfig(out_dir=root / "full", dump_params=True),
        limits=Limits(timeout_s=20),
    )
    cut, cut_s = _timed(
        three_device_plan(),
        steps=STEPS,
        output=OutputConfig(out_dir=root / "cut"),
        limits=Limits(timeout_s=10),
        fault=Fault(rank=1, kind=FaultKind.DIE, step=4, phase=FaultPhase.MID),
        checkpoint=CheckpointConfig(dir=str(ckpt), every_steps=2),
    )
    assert cut is None, "the fault should have stopped the run"
    want = _params(root / "full", 3)
    resumed = {}
    for name, plan, ranks in (("same_plan", three_device_plan(), 3), ("one_device_fewer", two_device_plan(), 2)):
        out, secs = _timed(
            plan,
            steps=STEPS,
            output=OutputConfig(out_dir=root / name, dump_params=True),
            limits=Limits(timeout_s=20),
            checkpoint=CheckpointConfig(resume=str(ckpt)),
        )
        assert out is not None
        resumed[name] = {
            "devices": list(out.devices),
            "steps_run": len(out.losses),
            "wall_s": round(secs, 2),
            "max_relative_difference": _max_rel(_params(root / name, ranks), want),
            "max_rss_bytes": max(r.max_rss_bytes for r in out.per_rank),
        }
    result = {
        "scenario": "tests' MLP, AdamW, batch 12, 10 steps on 3 gloo ranks, checkpoint every 2 steps, "
        "rank 1 killed mid step 5",
        "checkpoints_left": sorted(p.name for p in ckpt.iterdir()),
        "checkpoint_bytes": sum(f.stat().st_size for f in (ckpt / "step-00000004").iterdir()),
        "uninterrupted_wall_s": round(full_s, 2),
        "interrupted_wall_s": round(cut_s, 2),
        "uninterrupted_max_rss_bytes": max(r.max_rss_bytes for r in full.per_rank) if full else None,
        "resumed": resumed,
        "torch": torch.__version__,
    }
    out_path = ROOT / "benchmarks" / "results" / "resume_after_fault.json"
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
