"""`heterog simulate plan.json` end to end: a saved plan, graph and cluster, the analytic costs."""

import json

from typer.testing import CliRunner

from heterog.cli.main import app
from heterog.hardware.spec import cluster_to_dict, load_cluster
from tests.simulate_support import chain_graph, plan


def _files(tmp_path):
    g = chain_graph(6, flops=5e9, param_bytes=8_000_000, edge_bytes=4e5, batch_size=32)
    c = load_cluster("paper-8gpu")
    devs = ["v100/gpu0", "v100/gpu1", "gtx0/gpu0", "p100/gpu1"]
    import dataclasses

    p = plan(
        [
            ("front", ["l0", "l1", "l2"], [(d, 0.25) for d in devs]),
            ("back", ["l3", "l4", "l5"], [("v100/gpu0", 0.5), ("v100/gpu1", 0.5)]),
        ],
        batch_size=32,
        num_microbatches=2,
        schedule="1f1b",
    )
    p = dataclasses.replace(
        p, cluster=cluster_to_dict(c), cluster_fingerprint=c.fingerprint(), graph_fingerprint=g.fingerprint()
    )
    g.save(tmp_path / "g.json")
    p.save(tmp_path / "p.json")
    return tmp_path / "p.json", tmp_path / "g.json"


def test_simulate_command_json_and_trace(tmp_path):
    plan_path, graph_path = _files(tmp_path)
    trace = tmp_path / "trace.json"
    res = CliRunner().invoke(
        app, ["simulate", str(plan_path), "--graph", str(graph_path), "--json", "--trace", str(trace)]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["iteration_time_s"] > 0 and out["feasible"] is True
    assert set(out["devices"]) == {"v100/gpu0", "v100/gpu1", "gtx0/gpu0", "p100/gpu1"}
    assert abs(out["throughput_samples_per_s"] * out["iteration_time_s"] - 32) < 1e-6
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "sync" for e in events)
    # a human table, and recomputed priorities
    res = CliRunner().invoke(app, ["simulate", str(plan_path), "--graph", str(graph_path), "--priorities", "upward"])
    assert res.exit_code == 0, res.output
    assert "iteration" in res.stdout and "busiest links" in res.stdout


def test_simulate_command_names_a_plan_for_another_cluster(tmp_path):
    plan_path, graph_path = _files(tmp_path)
    res = CliRunner().invoke(app, ["simulate", str(plan_path), "--graph", str(graph_path), "--cluster", "mixed-16"])
    assert res.exit_code != 0
    assert "cluster" in str(res.exception) or "cluster" in res.output
