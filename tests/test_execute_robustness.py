"""A rank that dies or hangs ends the run within the timeout, naming the rank; no orphan
processes or namespaces remain, also when the launcher is interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from heterog.errors import RankError
from heterog.execute.netns import leftover_namespaces
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Fault, FaultKind, Limits, OutputConfig, PredictionConfig
from heterog.runs import run

MODELS = "tests/test_execute_models.py"
NODES = ("fc1", "act1", "fc2", "act2", "fc3")


def _plan(devices=("a", "b", "c")) -> Plan:
    share = 1.0 / len(devices)
    return Plan(
        strategy="test",
        model=ModelSpec(name=f"{MODELS}:mlp", batch_size=12),
        groups=(
            Group(
                name="all", nodes=NODES, sync="ring", replicas=tuple(Replica(device=d, share=share) for d in devices)
            ),
        ),
    )


def _workers_of(tmp_path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "heterog.execute.worker" in cmd and str(tmp_path) in cmd:
            out.append(p)
    return out


@pytest.mark.parametrize("kind", ["die", "hang"])
def test_failing_rank_is_named_and_nothing_is_left(tmp_path, kind):
    timeout_s = 6
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run(
            _plan(),
            steps=4,
            limits=Limits(timeout_s=timeout_s),
            output=OutputConfig(out_dir=tmp_path),
            prediction=PredictionConfig(predict=False),
            fault=Fault(rank=1, kind=FaultKind(kind), step=2),
        )
    elapsed = time.monotonic() - start
    assert info.value.rank == 1, str(info.value)
    assert ("died" if kind == "die" else "hung") in str(info.value)
    # start-up (~5 s on this machine) + the timeout + a grace period
    assert elapsed < 30 + 2 * timeout_s, elapsed
    assert _workers_of(tmp_path) == []


def test_rank_error_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(RankError(3, "hung at step 2")))
    assert e.rank == 3 and str(e) == "rank 3: hung at step 2"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_sigint_to_launcher_kills_ranks_and_removes_namespaces(tmp_path):
    """Interrupt a shaped run while a rank hangs: ranks and namespaces must all go."""
    script = textwrap.dedent(f"""
        from heterog.runs import run
        from heterog.ir.run_request import Fault, Limits, OutputConfig, PredictionConfig
        from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
        from heterog.ir.plan import Group, ModelSpec, Plan, Replica
        c = parse_cluster_yaml('''
        name: two-nodes
        kind: emulated
        nodes:
          - {{name: n0, nic_bandwidth_gbps: 1, devices: [{{type: cpu, name: n0/cpu0}}]}}
          - {{name: n1, nic_bandwidth_gbps: 1, devices: [{{type: cpu, name: n1/cpu0, slowdown: 2}}]}}
        ''')
        plan = Plan(strategy="t", model=ModelSpec(name="{MODELS}:mlp", batch_size=8),
                    groups=(Group(name="all", nodes={NODES!r}, sync="ring",
                                  replicas=(Replica(device="n0/cpu0", share=0.5),
                                            Replica(device="n1/cpu0", share=0.5))),),
                    cluster=cluster_to_dict(c))
        run(plan, steps=3, limits=Limits(timeout_s=120), output=OutputConfig(out_dir={str(tmp_path)!r}),
            prediction=PredictionConfig(predict=False), fault=Fault(rank=0, kind="hang", step=1))
    """)
    before = set(leftover_namespaces())
    # as from a terminal: SIGINT handled even when this test runs in a background job (ignored there)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "progress_rank1").exists():
            time.sleep(0.2)
        assert (tmp_path / "progress_rank1").exists(), "ranks did not start"
        assert set(leftover_namespaces()) - before, "the run made no namespaces"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:  # a failed check must not leave the run going
            proc.kill()
            proc.wait(timeout=30)
    assert _workers_of(tmp_path) == []
    assert set(leftover_namespaces()) - before == set()
