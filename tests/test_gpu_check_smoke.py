"""benchmarks/gpu_check.py's CPU smoke version: the script a person with one GPU runs first
must run here too (its sections on CPU devices, tiny models), so it is not broken when a GPU
turns up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    sections = doc["sections"]
    assert not [name for name, sec in sections.items() if "error" in sec]
    assert sections["env"]["cpu_smoke"] is True
    assert sections["check"]["all_ok"] and len(sections["check"]["rows"]) == 2
    assert all(r["heterog_step_s"] > 0 and r["plain_step_s"] > 0 for r in sections["steps"]["rows"])
    assert sections["shared"]["all_equal"]
