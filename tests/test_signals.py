"""Signals: SIGINT exits 130 and SIGTERM 143 with one line saying what stopped, during `plan`
and `run`, and nothing is left behind (no output file, no rank, no run folder, no network
namespace) — also after the launcher is killed by SIGKILL, once the next run has started.

Each test runs `heterog` as a real process with its own TMPDIR, so the run folders, the
registry of live runs and the namespace owner files it looks at are this test's alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from heterog.execute.netns import OWNERS_DIR, PREFIX, leftover_namespaces
from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
from heterog.ir.plan import Group, ModelSpec, Plan, Replica

MODEL = "tests/test_execute_models.py:mlp"
NODES = ("fc1", "act1", "fc2", "act2", "fc3")
TWO_NODES = """\
name: two-nodes
kind: emulated
nodes:
  - name: n0
    nic_bandwidth_gbps: 5
    devices: [{type: cpu}]
  - name: n1
    nic_bandwidth_gbps: 5
    devices: [{type: cpu}]
"""


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_orphans():
    """A test that fails before its command exits must not leave it running (a `heterog run
    --steps 100000` left behind loads the machine for every later test)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _heterog(args: list[str], tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "heterog.cli.main", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _STARTED.append(proc)
    return proc


def _plan_file(folder: Path) -> Path:
    """Data parallelism of a small MLP over two emulated nodes (links shaped when root)."""
    cluster = parse_cluster_yaml(TWO_NODES)
    plan = Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=12),
        cluster=cluster_to_dict(cluster),
        groups=(
            Group(
                name="all",
                nodes=NODES,
                sync="ring",
                replicas=(Replica(device="n0/cpu0", share=0.5), Replica(device="n1/cpu0", share=0.5)),
            ),
        ),
    )
    path = folder / "plan.json"
    plan.save(path)
    return path


def _ranks(tmp: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "heterog.execute.worker" in cmd and str(tmp) in cmd:
            out.append(p)
    return out


def _wait_for_training(tmp: Path, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    """Until a rank has reached step 2 (so the signal lands in the middle of training)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        for f in tmp.glob("heterog-run-*/progress_rank*"):
            try:
                if f.read_text().isdigit() and int(f.read_text()) >= 2:
                    return
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError("the ranks never started training")


def _namespaces_of(pid: int) -> set[str]:
    """The network namespaces launcher `pid` made (others' tests may make their own meanwhile)."""
    tokens = set()
    for f in OWNERS_DIR.glob("*.json") if OWNERS_DIR.is_dir() else []:
        try:
            if json.loads(f.read_text())["pid"] == pid:
                tokens.add(f.stem)
        except (OSError, ValueError, KeyError):
            pass
    return {ns for ns in leftover_namespaces() if ns[len(PREFIX) : len(PREFIX) + 6] in tokens}


def _assert_nothing_left(tmp: Path, namespaces: set[str]) -> None:
    deadline = time.monotonic() + 15
    while _ranks(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ranks(tmp) == []
    assert list(tmp.glob("heterog-run-*")) == []
    assert list((tmp / "heterog-live-runs").glob("*")) == [] if (tmp / "heterog-live-runs").exists() else True
    assert set(leftover_namespaces()) & namespaces == set()


def _wait_until_caught(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    """Until the CLI catches `sig` (its handler is installed after the imports). A process
    started from a shell's background job inherits SIGINT ignored, and a slow machine may
    still be importing after the test's first wait: a signal sent then is lost, not handled."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (sig - 1) & 1:
                return
        time.sleep(0.1)
    raise AssertionError(f"heterog never installed its handler for {signal.Signals(sig).name}")


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_plan(tmp_path, sig, code):
    out = tmp_path / "plan.json"
    proc = _heterog(
        [
            "plan",
            "--model",
            "resnet50",
            "--batch-size",
            "64",
            "--cluster",
            "mixed-16",
            "--budget-s",
            "120",
            "--out",
            str(out),
        ],
        tmp_path,
    )
    time.sleep(8)  # imports and capture; the search runs for up to two minutes
    _wait_until_caught(proc, sig)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines == [f"heterog plan stopped by {sig.name}; nothing partial was written."], stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_run(tmp_path, sig, code):
    plan = _plan_file(tmp_path)
    proc = _heterog(["run", str(plan), "--steps", "100000", "--out", str(tmp_path / "result.json")], tmp_path)
    _wait_for_training(tmp_path, proc)
    namespaces = _namespaces_of(proc.pid)
    assert bool(namespaces) == (os.geteuid() == 0)  # links are shaped when root
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"heterog run and its ranks stopped by {sig.name}; nothing partial was written."
    ), stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "result.json").exists()
    _assert_nothing_left(tmp_path, namespaces)


@pytest.mark.slow
def test_next_run_removes_what_a_killed_launcher_left(tmp_path):
    plan = _plan_file(tmp_path)
    proc = _heterog(["run", str(plan), "--steps", "100000"], tmp_path)
    _wait_for_training(tmp_path, proc)
    namespaces = _namespaces_of(proc.pid)
    proc.kill()  # SIGKILL: no finally runs
    proc.communicate(timeout=30)
    orphans = _ranks(tmp_path)
    assert orphans, "the killed launcher's ranks should still be running"
    assert list(tmp_path.glob("heterog-run-*"))
    assert set(leftover_namespaces()) & namespaces == namespaces  # as root: shaped links left behind
    nxt = _heterog(["run", str(plan), "--steps", "2", "--json"], tmp_path)
    stdout, stderr = nxt.communicate(timeout=180)
    assert nxt.returncode == 0, stderr
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in orphans)
    _assert_nothing_left(tmp_path, namespaces)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_dropped_inside_a_weakref_callback_still_stops_the_search():
    """Python drops an exception raised while a weakref callback runs (torch's run in every
    garbage collection): a stop signal landing there must still stop `heterog plan` at its
    next progress callback (it once ran on for the whole search budget)."""
    import weakref

    from heterog.cli import main as cli_main
    from heterog.cli.plan_cmd import _progress_bar

    cli_main.STOP_REQUESTED.clear()

    class Held:
        pass

    held = Held()
    ref = weakref.ref(held, lambda _: cli_main._interrupt(signal.SIGINT, None))
    del held  # the callback runs; its KeyboardInterrupt is reported, not raised
    assert ref() is None and cli_main.STOP_REQUESTED == [signal.SIGINT]
    _, update = _progress_bar(False)
    try:
        with pytest.raises(KeyboardInterrupt):
            update("search", 0.5)
    finally:
        cli_main.STOP_REQUESTED.clear()


def test_a_stop_reaches_the_search_when_the_cli_runs_as_python_m():
    """`python -m heterog.cli.main` (as these tests start it) runs main.py as `__main__`, a
    second copy of heterog.cli.main beside the one plan_cmd imports: the copy's handler must
    record the stop where the search's progress callback looks (it once did not, and a stop
    landing in a weakref callback left the search running for its whole budget)."""
    import runpy

    from heterog.cli.plan_cmd import _progress_bar

    as_main = runpy.run_module("heterog.cli.main", run_name="__not_main__")  # a fresh copy, not run
    _, update = _progress_bar(False)
    try:
        with pytest.raises(KeyboardInterrupt):
            as_main["_interrupt"](signal.SIGTERM, None)
        with pytest.raises(KeyboardInterrupt):
            update("search", 0.5)
    finally:
        as_main["STOP_REQUESTED"].clear()


def test_a_stop_dropped_inside_a_weakref_callback_prints_no_traceback(monkeypatch):
    """Python reports an exception raised in a weakref callback through sys.unraisablehook
    ("Exception ignored in …" and a traceback on stderr); for a stop it has recorded, the CLI
    reports nothing, so its one line is all a user sees (CI once saw that traceback above
    "heterog plan stopped by SIGINT"). Other such errors still reach the hook before it."""
    import weakref

    from heterog.cli import main as cli_main

    reported: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(type(u.exc_value)))

    class Held:
        pass

    with cli_main._signals_recorded():
        held = Held()
        ref = weakref.ref(held, lambda _: cli_main._interrupt(signal.SIGINT, None))
        del held
        assert ref() is None and cli_main.STOP_REQUESTED == [signal.SIGINT]
        held = Held()
        ref = weakref.ref(held, lambda _: 1 / 0)
        del held
    cli_main.STOP_REQUESTED.clear()
    assert reported == [ZeroDivisionError]
