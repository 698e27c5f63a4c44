"""GPU tests (marker `gpu`): skipped without CUDA, never required by CI. On a machine with
GPUs: a single-GPU plan, a two-rank plan when two GPUs are visible, amp-bf16, and the device
module's CUDA side. `heterog profile` on a GPU is in test_profile_calibrate.py."""

from __future__ import annotations

import pytest
import torch

from heterog.execute.device import RankDevice, nccl_env, rank_device
from heterog.ir.plan import Group, ModelSpec, Plan, Replica

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
MODELS = "tests/test_execute_models.py"
NODES = ("fc1", "act1", "fc2", "act2", "fc3")


def _gpu_cluster(n: int) -> dict:
    from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
    from heterog.hardware.catalog import gpu_from_device_name
    gpu = (gpu_from_device_name(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory).name
           if torch.cuda.is_available() else "H100-80GB")
    return cluster_to_dict(parse_cluster_yaml(
        f"name: local-gpus\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n"
        f"    devices: [{{type: {gpu}, count: {n}}}]\n"))


def _plan(n: int, precision: str = "fp32") -> Plan:
    from heterog.hardware.spec import cluster_from_dict
    c = _gpu_cluster(n)
    devs = [d.name for d in cluster_from_dict(c).devices]
    return Plan(strategy="test", model=ModelSpec(name=f"{MODELS}:mlp", batch_size=16), precision=precision,
                groups=(Group(name="all", nodes=NODES, sync="ring",
                              replicas=tuple(Replica(device=d, share=1 / n) for d in devs)),),
                cluster=c).validate()


def test_cpu_device_defaults():
    """The device module's CPU side (what the CPU suite runs everywhere)."""
    d = rank_device(use_cuda=False, index=3)
    assert d.torch_device == torch.device("cpu") and d.backend == "gloo"
    with d.autocast("amp-bf16"):
        y = torch.ones(4, 4) @ torch.ones(4, 4)
    assert y.dtype == torch.bfloat16
    with d.autocast("fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    t = d.timer()
    t.start()
    assert t.stop() >= 0.0
    assert d.memory()["peak_allocated_bytes"] > 0
    env, note = nccl_env({"A100-80GB", "V100-32GB"})
    assert env == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"} and "unlike GPU types" in note
    assert nccl_env({"A100-80GB"}) == ({}, None)
    assert nccl_env({"A100-80GB", "T4"}, {"NCCL_ALGO": "Tree"})[0]["NCCL_ALGO"] == "Tree"


@pytest.mark.gpu
@needs_cuda
def test_single_gpu_plan_runs_on_cuda(tmp_path):
    from heterog.pipeline import run
    out = run(_plan(1), steps=3, out_dir=tmp_path, predict=True, timeout_s=120)
    r = out["per_rank"][0]
    assert out["measured_iteration_time_s"] > 0 and out["predicted_iteration_time_s"] > 0
    assert r["peak_allocated_bytes"] > 0


@pytest.mark.gpu
@needs_cuda
def test_amp_bf16_on_cuda(tmp_path):
    from heterog.pipeline import run
    out = run(_plan(1, "amp-bf16"), steps=3, out_dir=tmp_path, predict=False, timeout_s=120)
    assert len(out["losses"]) == 3 and all(x == x for x in out["losses"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_plan_on_two_gpus_equals_single_process(tmp_path):
    from heterog.execute.reference import reference_train
    from heterog.pipeline import run
    plan = _plan(2)
    run(plan, steps=3, out_dir=tmp_path, dump_params=True, predict=False, timeout_s=120)
    ref = reference_train(plan, steps=3)
    got = torch.load(tmp_path / "params_rank0.pt", map_location="cpu")
    for k, v in got.items():
        assert ((v - ref[k]).norm() / ref[k].norm()).item() < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_memory_and_events():
    d = RankDevice(kind="cuda", index=0)
    d.activate()
    t = d.timer()
    t.start()
    x = torch.ones(1024, 1024, device=d.torch_device)
    (x @ x).sum().item()
    assert t.stop() > 0
    assert d.memory()["peak_allocated_bytes"] >= 4 * 1024 * 1024
