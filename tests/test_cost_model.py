"""Compute and memory model on a synthetic transformer graph (no capture needed)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from cost_support import linear, transformer_graph

from heterog.cost import Profile, ProfileError, build_cost_model
from heterog.cost.memory import block_of
from heterog.cost.predict import predict, single_device_cluster
from heterog.hardware.catalog import get_gpu
from heterog.hardware.efficiency import gpu_curve, h200_curve
from heterog.hardware.gputype import Efficiency
from heterog.hardware.spec import load_cluster
from heterog.ir.affine import Affine
from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpEdge, OpGraph


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(layers=3, hidden=512, seq=128, batch=8)


@pytest.fixture(scope="module")
def mixed():
    return load_cluster("mixed-16")


def names(g):
    return [n.name for n in g.nodes]


def test_time_grows_with_batch_and_has_a_floor(graph, mixed):
    m = build_cost_model(graph, mixed)
    ts = [m.group_time_s(names(graph), "a100/gpu0", b, Phase.FORWARD) for b in (1, 2, 8, 32, 128)]
    # never faster with more samples; flat while the host sets the pace (cost/host.py)
    assert all(a <= b for a, b in zip(ts, ts[1:])) and ts[-1] > ts[0]
    # host overhead floor: at batch 1 time is far above the proportional share of batch 128
    assert ts[0] > 2 * ts[-1] / 128
    kernels = sum(n.fwd_kernels for n in graph.nodes)
    assert ts[0] >= kernels * 8e-6 * 0.99  # per-op dispatch (catalog host_costs)
    assert m.compute_time_s(graph.nodes[1].name, "a100/gpu0", 0, Phase.FORWARD) == 0.0


def test_faster_gpus_are_faster_and_slowdown_scales(graph, mixed):
    m = build_cost_model(graph, mixed)
    t = {d: m.group_time_s(names(graph), d, 64, Phase.BACKWARD) for d in ("a100/gpu0", "v100/gpu0", "t4/gpu0")}
    assert t["a100/gpu0"] < t["v100/gpu0"] < t["t4/gpu0"]
    emu = load_cluster("emulated-4")
    me = build_cost_model(graph, emu)
    fast = me.group_time_s(names(graph), "fast/cpu0", 4, Phase.FORWARD)
    assert me.group_time_s(names(graph), "slow/cpu1", 4, Phase.FORWARD) == pytest.approx(4 * fast)


def test_group_time_is_the_sum_of_node_times(graph, mixed):
    m = build_cost_model(graph, mixed)
    ns = names(graph)[2:9]
    total = sum(m.compute_time_s(n, "v100/gpu1", 12, Phase.BACKWARD) for n in ns)
    assert m.group_time_s(ns, "v100/gpu1", 12, Phase.BACKWARD) == pytest.approx(total)
    assert np.allclose(
        m.node_times_s(ns, "v100/gpu1", 12, Phase.BACKWARD),
        [m.compute_time_s(n, "v100/gpu1", 12, Phase.BACKWARD) for n in ns],
    )


def test_precision_paths(graph):
    cl = single_device_cluster(get_gpu("A100-80GB"))
    dev = cl.devices[0].name
    fp32 = build_cost_model(graph, cl, precision="fp32").group_time_s(names(graph), dev, 64, Phase.FORWARD)
    bf16 = build_cost_model(graph, cl, precision="amp-bf16").group_time_s(names(graph), dev, 64, Phase.FORWARD)
    assert bf16 < fp32 / 3  # 312 vs 19.5 TFLOP/s peaks
    # T4 has no bf16: amp-bf16 falls back to fp32 rates, fp16 uses its tensor cores
    t4 = single_device_cluster(get_gpu("T4"))
    d4 = t4.devices[0].name
    t_bf16 = build_cost_model(graph, t4, precision="amp-bf16").group_time_s(names(graph), d4, 64, Phase.FORWARD)
    t_fp16 = build_cost_model(graph, t4, precision="fp16").group_time_s(names(graph), d4, 64, Phase.FORWARD)
    assert t_fp16 < t_bf16


def test_large_h200_matmul_matches_the_measurement():
    """A lone 8192³ bf16 product predicted within 10% of data/h200_micro.json's 1.403 ms."""
    n = 8192
    node = linear("mm", "mm", n, n, 1)
    node = type(node)(
        **{
            **{f: getattr(node, f) for f in node.__dataclass_fields__},
            "fwd_flops": Affine(0, 2.0 * n**3),
            "fwd_bytes": Affine(0, 3 * n * n * 2),
        }
    )
    g = OpGraph(model="mm", batch_size=1, nodes=(node,), edges=()).validate()
    cl = single_device_cluster(get_gpu("H200"))
    t = build_cost_model(g, cl, precision="amp-bf16").compute_time_s("mm", cl.devices[0].name, 1, Phase.FORWARD)
    assert t == pytest.approx(1.403e-3, rel=0.10)


def test_efficiency_curves_are_monotone_and_scaled():
    for p in ("fp32", "tf32", "bf16", "fp16"):
        eff = h200_curve(p).at(np.array([64, 256, 1024, 4096, 16384]))
        assert np.all(np.diff(eff) >= 0) and eff[-1] <= 1.0
    # the scaling rule: a smaller GPU reaches high efficiency at smaller sizes (before each
    # type's own fitted size_scale, which the catalog adds)
    plain = {n: dataclasses.replace(get_gpu(n), efficiency=Efficiency()) for n in ("T4", "H200")}
    assert gpu_curve(plain["T4"], "fp16").at(1024) > gpu_curve(plain["H200"], "fp16").at(1024)


def test_profile_overrides_and_validates(graph, mixed, tmp_path):
    node = graph.nodes[1].name
    prof = Profile(model=graph.model, times={node: {"A100-80GB": {"fwd": ((4.0, 1e-3), (8.0, 1.5e-3))}}})
    path = tmp_path / "p.json"
    prof.save(path)
    m = build_cost_model(graph, mixed, profile=path)
    assert m.compute_time_s(node, "a100/gpu0", 8, Phase.FORWARD) == pytest.approx(1.5e-3)
    assert m.compute_time_s(node, "a100/gpu0", 6, Phase.FORWARD) == pytest.approx(1.25e-3)
    assert m.compute_time_s(node, "a100/gpu0", 16, Phase.FORWARD) == pytest.approx(2.5e-3)  # linear fit beyond
    assert m.compute_time_s(node, "v100/gpu0", 8, Phase.FORWARD) != pytest.approx(1.5e-3)  # not measured there
    bad = json.loads(path.read_text())
    bad["times"][node]["A100-80GB"]["fwd"] = [[4, -1]]
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"batch > 0, time_s ≥ 0"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="not in the graph"):
        build_cost_model(graph, mixed, profile=Profile(times={"nope": {"T4": {"fwd": ((1.0, 1.0),)}}}))


def test_memory_grows_linearly_in_batch(graph, mixed):
    m = build_cost_model(graph, mixed)
    peaks = [m.memory.step_peak(b).peak_bytes for b in (8, 16, 24, 32)]
    steps = np.diff(peaks)
    assert steps[0] > 0 and np.allclose(steps, steps[0], rtol=1e-9)
    acts = [m.activation_bytes(names(graph), b) for b in (1, 2, 3)]
    assert acts[2] - acts[1] == pytest.approx(acts[1] - acts[0])


def test_persistent_state_by_optimizer(graph, mixed):
    params = float(sum(n.param_bytes for n in graph.nodes))
    sgd = build_cost_model(graph, mixed, optimizer="sgd").persistent_bytes(names(graph), "t4/gpu0")
    adamw = build_cost_model(graph, mixed, optimizer="adamw").persistent_bytes(names(graph), "t4/gpu0")
    assert sgd == pytest.approx(3 * params) and adamw == pytest.approx(4 * params)


def test_recompute_saves_activations_and_costs_time(graph, mixed):
    assert block_of("blocks.2.mlp.fc1") == "blocks.2" and block_of("head") is None
    plain = build_cost_model(graph, mixed)
    rc = build_cost_model(graph, mixed, recompute=True)
    ns = names(graph)
    assert rc.activation_bytes(ns, 32) < 0.6 * plain.activation_bytes(ns, 32)
    assert rc.memory.step_peak(32, recompute=True).peak_bytes < plain.memory.step_peak(32).peak_bytes
    fwd = plain.group_time_s(ns, "a100/gpu0", 32, Phase.FORWARD)
    extra = rc.group_time_s(ns, "a100/gpu0", 32, Phase.BACKWARD) - plain.group_time_s(
        ns, "a100/gpu0", 32, Phase.BACKWARD
    )
    assert 0.8 * fwd < extra <= fwd


def test_amp_halves_matmul_activations(graph, mixed):
    fp32 = build_cost_model(graph, mixed).activation_bytes(["blocks.0.attn.qkv"], 64)
    amp = build_cost_model(graph, mixed, precision="amp-bf16").activation_bytes(["blocks.0.attn.qkv"], 64)
    cast = 2.0 * graph.node("blocks.0.attn.qkv").param_count  # the saved bf16 weight copy
    assert amp == pytest.approx(fp32 / 2 + cast)


def test_transfer_and_edges(graph, mixed):
    m = build_cost_model(graph, mixed)
    a, b = graph.nodes[1].name, graph.nodes[2].name
    nbytes = m.activation_transfer_bytes(a, b, 16)
    assert nbytes == pytest.approx(graph.nodes[1].output_bytes.at(16))
    assert m.activation_transfer_bytes(b, a, 16) == 0.0
    assert m.transfer_time_s(nbytes, "a100/gpu0", "t4/gpu0") > m.transfer_time_s(nbytes, "a100/gpu0", "a100/gpu1")


def test_predict_is_sane_and_monotone(graph):
    rs = [predict(graph, batch_size=b, device="V100-32GB") for b in (4, 8, 16)]
    for r in rs:
        assert {"iteration_time_s", "peak_memory_bytes", "flops_per_iteration", "breakdown", "fits", "device"} <= set(r)
        assert r["fits"] and math.isfinite(r["iteration_time_s"])
        # the step cannot beat the device's peak
        assert r["flops_per_iteration"] / r["iteration_time_s"] < get_gpu("V100-32GB").peak_flops_per_s["fp32"]
    assert rs[0]["iteration_time_s"] < rs[1]["iteration_time_s"] < rs[2]["iteration_time_s"]
    assert rs[0]["peak_memory_bytes"] < rs[1]["peak_memory_bytes"] < rs[2]["peak_memory_bytes"]
    big = predict(graph, batch_size=100_000, device="T4")
    assert not big["fits"]
    adam = predict(graph, batch_size=8, device="V100-32GB", optimizer="adamw")
    assert adam["breakdown"]["optimizer_state_bytes"] == pytest.approx(2 * rs[1]["breakdown"]["optimizer_state_bytes"])


@pytest.mark.parametrize("dtype,precision", [("bf16", "amp-bf16"), ("fp16", "fp16"), ("fp32", "fp32")])
def test_h200_calibration_points(dtype, precision):
    """Every large square product of data/h200_micro.json is predicted within 15% (from 4096 on,
    where the ~15 µs launch-and-timing floor of the measurement is under 10%)."""
    from heterog.hardware.efficiency import _h200_doc

    cl = single_device_cluster(get_gpu("H200"))
    for row in _h200_doc()["matmul"]:
        if row["dtype"] != dtype or row["m"] < 4096:
            continue
        n = row["m"]
        base = linear("mm", "mm", n, n, 1)
        node = type(base)(
            **{
                **{f: getattr(base, f) for f in base.__dataclass_fields__},
                "fwd_flops": Affine(0, 2.0 * n**3),
                "fwd_bytes": Affine(0, 3.0 * n * n * 4),
            }
        )
        g = OpGraph(model="mm", batch_size=1, nodes=(node,), edges=()).validate()
        t = build_cost_model(g, cl, precision=precision).compute_time_s("mm", cl.devices[0].name, 1, Phase.FORWARD)
        assert t == pytest.approx(row["median_ms"] * 1e-3, rel=0.15), (dtype, n)


def test_recompute_kept_bytes_add_up_over_groups_and_the_transient_is_one_block(graph, mixed):
    """Splitting a model into groups must not count the rebuilt block once per group."""
    rc = build_cost_model(graph, mixed, recompute=True)
    plain = build_cost_model(graph, mixed)
    ns = names(graph)
    cut = ns.index("blocks.2.ln1")  # groups cut at block boundaries
    halves = [ns[:cut], ns[cut:]]
    assert sum(rc.activation_bytes(h, 32) for h in halves) == pytest.approx(rc.activation_bytes(ns, 32))
    block = [n for n in ns if n.startswith("blocks.0.")]
    largest = max(plain.activation_bytes([n for n in ns if n.startswith(f"blocks.{i}.")], 32) for i in range(3))
    assert rc.recompute_transient_bytes(ns, 32) == pytest.approx(largest)
    assert rc.recompute_transient_bytes(block, 32) <= plain.activation_bytes(block, 32)


def test_simulated_peak_with_recompute_falls_when_groups_are_fine(graph, mixed):
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica
    from heterog.simulate.simulator import simulate

    def plan(recompute):
        groups = tuple(
            Group(name=f"g{i}", nodes=(n.name,), recompute=recompute, replicas=(Replica(device="t4/gpu0", share=1.0),))
            for i, n in enumerate(graph.nodes)
        )
        return Plan(strategy="t", model=ModelSpec(name="x", batch_size=32), groups=groups)

    costs = build_cost_model(graph, mixed)
    full = simulate(graph, mixed, plan(False), costs).peak_memory_bytes["t4/gpu0"]
    kept = simulate(graph, mixed, plan(True), costs).peak_memory_bytes["t4/gpu0"]
    persistent = costs.persistent_bytes(names(graph), "t4/gpu0")
    saved = costs.activation_bytes(names(graph), 32)
    # recompute must remove a good part of the activations, even with one group per node
    assert kept < full - 0.3 * saved and kept > persistent


def test_bf16_batch_norm_runs_natively_and_gains_nothing_from_half_bytes():
    """PyTorch gives bf16 batch norms to its native kernels, not cuDNN's (cost.roofline,
    NATIVE_BN_BF16_FACTOR): under amp-bf16 a memory-bound batch norm takes its fp32 time,
    while an element-wise op after a half matmul halves, and fp16 (cuDNN) halves too."""
    from cost_support import elementwise

    seq, width = 4096, 4096
    lin = linear("fc", "fc", width, width, seq)
    bn = dataclasses.replace(elementwise("bn", "bn", "norm", seq * width), module_type="BatchNorm2d")
    act = elementwise("act", "act", "elementwise", seq * width)
    times = {}
    for other in (bn, act):
        g = OpGraph(
            model="t",
            nodes=(lin, other),
            edges=(OpEdge(src="fc", dst=other.name, bytes=lin.output_bytes),),
            input_bytes=Affine(0, seq * width * 4),
            batch_size=1,
        )
        for gpu, precisions in (("H200", ("fp32", "amp-bf16")), ("V100-16GB", ("fp32", "fp16"))):
            cl = single_device_cluster(get_gpu(gpu))
            for p in precisions:
                times[other.name, gpu, p] = build_cost_model(g, cl, precision=p).group_time_s(
                    [other.name], cl.devices[0].name, 8, Phase.FORWARD
                )
    assert times["bn", "H200", "amp-bf16"] == pytest.approx(times["bn", "H200", "fp32"], rel=0.05)
    assert times["act", "H200", "amp-bf16"] == pytest.approx(times["act", "H200", "fp32"] / 2, rel=0.05)
    assert times["bn", "V100-16GB", "fp16"] == pytest.approx(times["bn", "V100-16GB", "fp32"] / 2, rel=0.05)
