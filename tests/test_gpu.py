"""GPU tests (marker `gpu`): skipped without CUDA, never required by CI. On a machine with
GPUs: a single-GPU plan, a two-rank plan when two GPUs are visible, amp-bf16 and fp16, the
device module's CUDA side; GPT-2, Llama and BERT under a 1F1B pipeline and an uneven hybrid —
`heterog check --device cuda` and training equal to single-process training, with the two
ranks on two GPUs (NCCL) or sharing one (gloo with host copies); a rank refusing a GPU of
another type than its plan's. `heterog profile` on a GPU is in test_profile_calibrate.py.
benchmarks/gpu_check.py runs these first."""

from __future__ import annotations

import pytest
import torch

from heterog.execute.device import RankDevice, nccl_env, rank_device
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import DeviceLayout, Limits, OutputConfig, PredictionConfig, RunOptions

QUIET = RunOptions(prediction=PredictionConfig(predict=False), limits=Limits(timeout_s=120))

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
MODELS = "tests/test_execute_models.py"
NODES = ("fc1", "act1", "fc2", "act2", "fc3")


def _gpu_cluster(n: int) -> dict:
    from heterog.hardware.catalog import gpu_from_device_name
    from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml

    gpu = (
        gpu_from_device_name(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory).name
        if torch.cuda.is_available()
        else "H100-80GB"
    )
    return cluster_to_dict(
        parse_cluster_yaml(
            f"name: local-gpus\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n"
            f"    devices: [{{type: {gpu}, count: {n}}}]\n"
        )
    )


def _plan(n: int, precision: str = "fp32") -> Plan:
    from heterog.hardware.spec import cluster_from_dict

    c = _gpu_cluster(n)
    devs = [d.name for d in cluster_from_dict(c).devices]
    return Plan(
        strategy="test",
        model=ModelSpec(name=f"{MODELS}:mlp", batch_size=16),
        precision=precision,
        groups=(
            Group(name="all", nodes=NODES, sync="ring", replicas=tuple(Replica(device=d, share=1 / n) for d in devs)),
        ),
        cluster=c,
    ).validate()


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
    from heterog.runs import run

    out = run(
        _plan(1),
        steps=3,
        output=OutputConfig(out_dir=tmp_path),
        prediction=PredictionConfig(predict=True),
        limits=Limits(timeout_s=120),
    )
    r = out.per_rank[0]
    assert out.measured_iteration_time_s > 0 and out.predicted_iteration_time_s > 0
    assert r.peak_allocated_bytes > 0
    assert r.predicted_peak_memory_bytes > 0 and out.by_kind()  # measured beside predicted


@pytest.mark.gpu
@needs_cuda
def test_amp_bf16_on_cuda(tmp_path):
    from heterog.runs import run

    out = run(
        _plan(1, "amp-bf16"),
        QUIET,
        steps=3,
        output=OutputConfig(out_dir=tmp_path),
    )
    assert len(out.losses) == 3 and all(x == x for x in out.losses)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_plan_on_two_gpus_equals_single_process(tmp_path):
    from heterog.execute.reference import reference_train
    from heterog.runs import run

    plan = _plan(2)
    run(
        plan,
        QUIET,
        steps=3,
        output=OutputConfig(out_dir=tmp_path, dump_params=True),
    )
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


SEQ = 8
LANGUAGE_MODELS = {
    "gpt2": dict(hidden=32, layers=2, heads=4, vocab=96, positions=32, dropout=0.0),
    "llama": dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=96, positions=32),
    "bert-large": dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96, positions=32, dropout=0.0),
}


def _split_plan(model: str, kind: str, precision: str = "fp32") -> Plan:
    """A 2-stage 1F1B pipeline or an uneven hybrid of a small language model on two devices
    of this machine's GPU type."""
    from heterog.capture import capture_model
    from heterog.hardware.spec import cluster_from_dict

    args = LANGUAGE_MODELS[model]
    nodes = [n.name for n in capture_model(model, args, batch_size=2, seq_len=SEQ).nodes]
    front, back = tuple(nodes[: len(nodes) // 2]), tuple(nodes[len(nodes) // 2 :])
    c = _gpu_cluster(2)
    a, b = [d.name for d in cluster_from_dict(c).devices]
    if kind == "pipeline":
        groups = (
            Group(name="s0", nodes=front, replicas=(Replica(device=a, share=1.0),)),
            Group(name="s1", nodes=back, replicas=(Replica(device=b, share=1.0),)),
        )
    else:
        groups = (
            Group(name="front", nodes=front, replicas=(Replica(device=a, share=1.0),)),
            Group(
                name="back",
                nodes=back,
                sync="ring",
                replicas=(Replica(device=a, share=2 / 3), Replica(device=b, share=1 / 3)),
            ),
        )
    return Plan(
        strategy=kind,
        model=ModelSpec(name=model, args=args, batch_size=6, seq_len=SEQ),
        groups=groups,
        num_microbatches=2 if kind == "pipeline" else 1,
        schedule="1f1b" if kind == "pipeline" else "gpipe",
        precision=precision,
        cluster=c,
    ).validate()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["pipeline", "hybrid"])
@pytest.mark.parametrize("model", list(LANGUAGE_MODELS))
def test_language_model_plans_check_on_cuda(model, kind):
    from heterog.orchestrate import check

    result = check(_split_plan(model, kind), device="cuda")
    assert result.ok, [r.problem for r in result.ranks]
    assert all(r.computes_run == r.computes > 0 and r.peak_memory_bytes for r in result.ranks)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["pipeline", "hybrid"])
@pytest.mark.parametrize("model", list(LANGUAGE_MODELS))
def test_language_model_plans_train_on_cuda_as_single_process(tmp_path, model, kind):
    """Two ranks on two GPUs (NCCL), or sharing one (gloo, host copies): parameters after 3
    steps equal single-process training on the CPU (within GPU-vs-CPU rounding)."""
    from heterog.execute.reference import reference_train
    from heterog.runs import run

    plan = _split_plan(model, kind)
    out = run(
        plan,
        QUIET,
        steps=3,
        output=OutputConfig(out_dir=tmp_path, dump_params=True),
        limits=Limits(timeout_s=300),
        layout=DeviceLayout(share_gpus=True),
    )
    assert all(r.torch_device.startswith("cuda") for r in out.per_rank)
    ref = reference_train(plan, steps=3)
    for rank in range(2):
        for name, value in torch.load(tmp_path / f"params_rank{rank}.pt").items():
            rel = ((value - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)).item()
            assert rel < 1e-4 or (value - ref[name]).abs().max().item() < 1e-6, (name, rel)


@pytest.mark.gpu
@needs_cuda
def test_fp16_trains_on_cuda_with_a_loss_scale(tmp_path):
    from heterog.runs import run

    out = run(
        _plan(1, "fp16"),
        QUIET,
        steps=3,
        output=OutputConfig(out_dir=tmp_path),
    )
    assert out.last.loss_scales == (65536.0,) * 3 and all(x == x for x in out.losses)


@pytest.mark.gpu
@needs_cuda
def test_a_rank_refuses_a_gpu_of_another_type(tmp_path):
    """The plan's device is a T4 (an A100-80GB on a T4 machine); the rank finds this machine's
    GPU instead and stops before training, naming both."""
    from heterog.errors import RankError
    from heterog.hardware.spec import cluster_from_dict, cluster_to_dict, parse_cluster_yaml
    from heterog.runs import run

    local = _gpu_cluster(1)["nodes"][0]["devices"][0]["type"]
    other = "T4" if local != "T4" else "A100-80GB"
    c = cluster_to_dict(
        parse_cluster_yaml(
            f"name: wrong\nnodes:\n  - name: box\n    nic_bandwidth_gbps: 100\n"
            f"    devices: [{{type: {other}, count: 1}}]\n"
        )
    )
    dev = cluster_from_dict(c).devices[0].name
    plan = Plan(
        strategy="test",
        model=ModelSpec(name=f"{MODELS}:mlp", batch_size=16),
        groups=(Group(name="all", nodes=NODES, replicas=(Replica(device=dev, share=1.0),)),),
        cluster=c,
    ).validate()
    with pytest.raises(RankError, match=f"a {other}, but its GPU cuda:0"):
        run(plan, steps=1, prediction=PredictionConfig(predict=False), limits=Limits(timeout_s=60))
