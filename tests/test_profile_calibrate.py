"""`heterog profile` → DeviceProfile → `heterog calibrate` → a catalog entry that
--device can name (HETEROG_CATALOG), and `predict --profile`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from heterog.cli.main import app
from heterog.cost.calibrate import calibrate, fit_host_scale, scale_host
from heterog.cost.device_profile import DeviceProfile, DeviceProfileError
from heterog.cost.predict import predict
from heterog.hardware import catalog
from heterog.hardware.catalog import get_gpu, host_costs
from heterog.ir.kinds import Phase

H200_MICRO = Path(__file__).resolve().parent.parent / "src" / "heterog" / "hardware" / "data" / "h200_micro.json"
runner = CliRunner()


def test_calibrating_the_h200_sweep_reproduces_its_large_products(tmp_path, monkeypatch):
    """Fitted on the real H200 matmul sweep (h200_micro.json), the new type predicts those
    products within 15% from n = 4096 on, and is found by name through HETEROG_CATALOG."""
    prof = DeviceProfile.from_shared_files([H200_MICRO], "H200")
    entry = calibrate(prof, name="H200-lab")
    out = tmp_path / "lab.yaml"
    out.write_text(yaml.safe_dump({"version": 1, "gpus": [entry]}))
    monkeypatch.setenv(catalog.CATALOG_ENV, str(out))
    gpu = get_gpu("H200-lab")
    assert gpu.efficiency.inherits == "H200" and gpu.host is not None
    for g in prof.gemm:
        if g["n"] < 4096 or g["dtype"] not in gpu.efficiency.compute:
            continue
        achieved = 2 * g["n"] ** 3 / g["time_s"]
        from heterog.hardware.efficiency import gpu_curve

        model = (
            gpu.peak_flops_per_s[g["dtype"]]
            * float(gpu_curve(gpu, g["dtype"]).at(g["n"]))
            * gpu.efficiency.compute[g["dtype"]]
        )
        assert model == pytest.approx(achieved, rel=0.15), g
    assert 0.5 < gpu.efficiency.memory <= 1.0


def test_the_host_scale_fit_recovers_a_known_host(monkeypatch):
    """Steps made by a host twice as slow as the default are fitted back to a scale of ~2."""
    from cost_support import transformer_graph

    import heterog.cost.predict as pred

    graph = transformer_graph(layers=2, hidden=128, seq=32, batch=2)
    monkeypatch.setitem(pred._CAPTURES, ("toy-transformer", (), 1, None), graph)
    gpu = get_gpu("H200")
    slow = dataclasses.replace(gpu, host=scale_host(host_costs(gpu), 2.0))
    steps = [
        {
            "model": "toy-transformer",
            "batch_size": b,
            "time_s": predict(graph, batch_size=b, device=slow)["iteration_time_s"],
        }
        for b in (1, 2, 4)
    ]
    prof = DeviceProfile.from_dict({"device": {"type": "H200"}, "steps": steps})
    assert fit_host_scale(prof, gpu) == pytest.approx(2.0, rel=0.05)


def test_a_malformed_profile_says_what_is_wrong(tmp_path):
    with pytest.raises(DeviceProfileError, match="gemm\\[0\\]"):
        DeviceProfile.from_dict({"device": {"type": "H200"}, "gemm": [{"n": 8, "dtype": "int8", "time_s": 1}]})
    with pytest.raises(DeviceProfileError, match="'device'"):
        DeviceProfile.from_dict({"gemm": []})
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: 3\n")
    import os

    os.environ[catalog.CATALOG_ENV] = str(bad)
    try:
        with pytest.raises(Exception, match="gpus"):
            get_gpu("H200")
    finally:
        del os.environ[catalog.CATALOG_ENV]


@pytest.mark.slow  # ~20 s: two gloo ranks start, and the model is stepped and profiled
def test_profile_on_this_cpu_then_predict_with_it(tmp_path):
    """The whole command on the CPU (quick; gloo between two local ranks), then predict
    --profile uses its per-node times."""
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["profile", "--out", str(out), "--quick", "--model", "mlp", "--batch-sizes", "2,8"])
    assert r.exit_code == 0, r.output
    prof = DeviceProfile.load(out)
    assert prof.device_type == "cpu" and prof.gemm and prof.copy and prof.host
    assert prof.comm["backend"] == "gloo" and all(row["allreduce_s"] > 0 for row in prof.comm["rows"])
    assert [s["batch_size"] for s in prof.steps] == [2, 8] and prof.nodes is not None
    r = runner.invoke(
        app, ["predict", "--model", "mlp", "--batch-size", "4", "--device", "cpu", "--profile", str(out), "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["iteration_time_s"] > 0
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--cluster",
            "emulated-4",
            "--budget-s",
            "1",
            "--no-gnn",
            "--max-iters",
            "10",
            "--profile",
            str(out),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["best"]["predicted_iteration_time_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_and_calibrate_on_a_gpu(tmp_path):  # pragma: no cover - GPU only
    out, cat = tmp_path / "p.json", tmp_path / "c.yaml"
    r = runner.invoke(app, ["profile", "--out", str(out), "--model", "resnet50", "--batch-sizes", "1,32", "--no-comm"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["calibrate", str(out), "--name", "this-gpu", "--out", str(cat)])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(cat.read_text())["gpus"][0]["name"] == "this-gpu"


def test_the_host_speed_fit_recovers_a_known_node(monkeypatch):
    """Steps measured on a node whose host runs at half the reference speed are fitted back
    to host_speed ≈ 0.5, the figure a cluster YAML's node takes; the profile keeps it."""
    from cost_support import transformer_graph

    import heterog.cost.predict as pred
    from heterog.cost.calibrate import fit_host_speed

    graph = transformer_graph(layers=2, hidden=128, seq=32, batch=2)
    monkeypatch.setitem(pred._CAPTURES, ("toy-transformer", (), 1, None), graph)
    steps = [
        {
            "model": "toy-transformer",
            "batch_size": b,
            "time_s": predict(graph, batch_size=b, device="H200", host_speed=0.5)["iteration_time_s"],
        }
        for b in (1, 2, 4)
    ]
    prof = DeviceProfile.from_dict({"device": {"type": "H200"}, "steps": steps})
    speed = fit_host_speed(prof, get_gpu("H200"))
    assert speed == pytest.approx(0.5, rel=0.05)
    back = DeviceProfile.from_dict({**dataclasses.replace(prof, host_speed=speed).to_dict()})
    assert back.host_speed == pytest.approx(speed)
    assert fit_host_speed(DeviceProfile.from_dict({"device": {"type": "H200"}}), get_gpu("H200")) is None
    with pytest.raises(DeviceProfileError, match="host_speed"):
        DeviceProfile.from_dict({"device": {"type": "H200"}, "host_speed": 0})


def test_profile_calibrate_plan_round_trip_on_this_cpu(tmp_path):
    """`heterog profile` on the CPU → `heterog calibrate` → a catalog entry a cluster file names
    (`catalog:`) → `heterog plan --profile FILE:TYPE`: the plan's devices of that type are
    costed with the measured per-node times. Seconds: one quick profile, no two-rank comm."""
    from heterog.cost import build_cost_model
    from heterog.cost.calibrated import apply_profiles
    from heterog.cost.predict import _captured
    from heterog.hardware.spec import load_cluster

    prof, cat = tmp_path / "p.json", tmp_path / "lab-catalog.yaml"
    r = runner.invoke(
        app, ["profile", "--out", str(prof), "--quick", "--no-comm", "--model", "mlp", "--batch-sizes", "2,8"]
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["calibrate", str(prof), "--name", "lab-cpu", "--out", str(cat)])
    assert r.exit_code == 0, r.output
    entry = yaml.safe_load(cat.read_text())["gpus"][0]
    measured = DeviceProfile.load(prof)
    best_fp32 = max(2 * g["n"] ** 3 / g["time_s"] for g in measured.gemm if g["dtype"] == "fp32")
    assert entry["vendor"] == "cpu" and entry["peak_tflops"]["fp32"] == pytest.approx(best_fp32 / 1e12)
    spec = tmp_path / "lab.yaml"
    spec.write_text(
        "name: lab\nkind: emulated\ncatalog: lab-catalog.yaml\nnodes:\n  - name: a\n"
        "    nic_bandwidth_gbps: 1\n    devices: [{type: lab-cpu, count: 2}]\n"
    )
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--cluster",
            str(spec),
            "--budget-s",
            "1",
            "--no-gnn",
            "--max-iters",
            "10",
            "--profile",
            f"{prof}:lab-cpu",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    best = json.loads(r.output)["best"]
    assert set(best["cluster"]["gpu_types"]) == {"lab-cpu"} and best["predicted_iteration_time_s"] > 0
    # the cost model the plan used takes the profile's times for the nodes it measured
    cluster, times = apply_profiles(load_cluster(spec), [f"{prof}:lab-cpu"])
    costs = build_cost_model(_captured("mlp", None, 1, None), cluster, profile=times)
    node, by_type = next(iter(measured.nodes.times.items()))
    batch, time_s = by_type["cpu"]["fwd"][0]
    assert costs.compute_time_s(node, "a/cpu0", batch, Phase.FORWARD) == pytest.approx(time_s)


def test_a_gpu_profile_calibrates_its_type_in_the_plan_cluster():
    """A device profile of a GPU applied to a cluster replaces that type's figures with the
    calibration's; a profile of a type the cluster lacks says which types it has."""
    from heterog.cost.calibrated import apply_profiles
    from heterog.cost.profile import ProfileError
    from heterog.hardware.spec import cluster_from_dict

    doc = {
        "name": "h",
        "nodes": [{"name": "n", "nic_bandwidth_gbps": 100, "devices": [{"type": "H200", "count": 2}, {"type": "T4"}]}],
    }
    prof = DeviceProfile.from_shared_files([H200_MICRO], "H200")
    cluster, times = apply_profiles(cluster_from_dict(doc), [prof])
    assert times is None and cluster.gpu_types["H200"].efficiency.source.startswith("heterog calibrate")
    assert cluster.gpu_types["T4"] == get_gpu("T4")
    other = cluster_from_dict({**doc, "nodes": [{**doc["nodes"][0], "devices": [{"type": "T4"}]}]})
    with pytest.raises(ProfileError, match=r"no device of type 'H200'; name the type it stands for"):
        apply_profiles(other, [prof])


def test_a_cluster_file_names_a_missing_catalog(tmp_path):
    from heterog.errors import ClusterError
    from heterog.hardware.spec import load_cluster

    spec = tmp_path / "c.yaml"
    spec.write_text(
        "name: c\ncatalog: nowhere.yaml\nnodes:\n  - name: a\n    nic_bandwidth_gbps: 1\n    devices: [{type: T4}]\n"
    )
    with pytest.raises(ClusterError, match=r"c.yaml:2: field catalog: .*nowhere.yaml.*cannot be read"):
        load_cluster(spec)
