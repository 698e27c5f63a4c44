"""The tree stays linted, formatted and typed: ruff (lint and format) over src, tests and
benchmarks, mypy over src/heterog, configured in pyproject.toml. mypy keeps its cache in
.mypy_cache: about a minute cold on two cores, seconds after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "benchmarks"]


def _run(*args: str, timeout_s: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "--no-cache", *PATHS)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_the_tree_is_ruff_formatted():
    out = _run("ruff", "format", "--check", *PATHS)
    assert out.returncode == 0, "run `ruff format src tests benchmarks`:\n" + out.stdout[-4000:]


def test_mypy_finds_nothing():
    out = _run("mypy")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
