"""The demo's scenarios are clusters where placement matters (speed, a slow link, a capped
memory), and `heterog run --repetitions` reports the median and the spread of several runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from heterog.capture import capture_model
from heterog.cli.main import app
from heterog.demo import DEMO_SCENARIO, SCENARIOS, placement, speedup
from heterog.ir.plan import Group, ModelSpec, Plan, Replica


def test_scenarios_differ_in_speed_links_and_memory():
    assert {s.family for s in SCENARIOS.values()} == {"cnn", "transformer-lm"}
    assert DEMO_SCENARIO in SCENARIOS
    for sc in SCENARIOS.values():
        cluster = sc.cluster()
        assert cluster.kind == "emulated"
        assert len({d.slowdown for d in cluster.devices}) > 1  # unlike in speed
        nics = {n.name: n.nic_bandwidth_bytes_per_s for n in cluster.nodes}
        assert nics["b"] == pytest.approx(sc.slow_link_gbps * 1e9 / 8) and nics["b"] < nics["a"]
        capped = [d.name for d in cluster.devices if d.memory_bytes is not None]
        assert capped == list(sc.capped_devices) and bool(capped) == bool(sc.memory_gib)
        for d in capped:
            assert cluster.memory_bytes(d) == int(sc.memory_gib * 2**30)


def test_speedup_holds_only_at_the_worst_repetition():
    strategies = {
        "heterog": {"repetitions_s": [1.0, 1.0, 2.0], "predicted_iteration_time_s": 1.0},
        "base": {"repetitions_s": [2.0, 1.5, 1.8], "predicted_iteration_time_s": 2.0},
    }
    sp = speedup(strategies, "base")
    assert sp["median"] == pytest.approx(1.5) and sp["worst"] == pytest.approx(0.9)
    assert not sp["holds"] and sp["predicted"] == pytest.approx(2.0)


def test_placement_lists_the_runs_of_groups_with_one_placement():
    nodes = [n.name for n in capture_model("mlp", None, batch_size=8).nodes]
    half = len(nodes) // 2
    dp = (Replica(device="a/c0", share=0.75), Replica(device="a/c1", share=0.25))
    groups = (
        Group(name="g0", nodes=tuple(nodes[:1]), sync="ring", replicas=dp),
        Group(name="g1", nodes=tuple(nodes[1:half]), sync="ring", replicas=dp),
        Group(
            name="g2",
            nodes=tuple(nodes[half:]),
            sync="ps",
            ps_device="a/c1",
            replicas=(Replica(device="a/c1", share=1.0),),
        ),
    )
    got = placement(Plan(strategy="hand", model=ModelSpec(name="mlp", batch_size=8), groups=groups))
    assert got["num_microbatches"] == 1
    assert [(s["first"], s["last"], s["nodes"], s["sync"], s["ps_device"]) for s in got["segments"]] == [
        (0, 1, half, "ring", None),
        (2, 2, len(nodes) - half, "ps", "a/c1"),
    ]
    assert got["segments"][0]["shares"] == {"a/c0": 0.75, "a/c1": 0.25}
    json.dumps(got)  # it goes into the benchmarks' results as it is


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_heterog_run_reports_median_and_spread_of_repetitions(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: two\nkind: emulated\nnodes:\n  - name: n\n    nic_bandwidth_gbps: 10\n"
        "    devices:\n      - {type: cpu, name: n/c0}\n      - {type: cpu, name: n/c1, slowdown: 2}\n"
    )
    plan = tmp_path / "plan.json"
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "16",
            "--cluster",
            str(cluster),
            "--budget-s",
            "1",
            "--json",
            "--out",
            str(plan),
        ],
    )
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["run", str(plan), "--steps", "3", "--repetitions", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert len(out["repetitions_s"]) == 2 and out["spread"] >= 0
    assert min(out["repetitions_s"]) <= out["measured_iteration_time_s"] <= max(out["repetitions_s"])
