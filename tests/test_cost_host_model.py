"""The GPU cost model's mechanisms: host pacing, autocast casts, per-type
sustained efficiency. Accuracy against measurements is benchmarks/predict_gpu.py's job."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cost_support import conv_graph, transformer_graph

from heterog.cost import build_cost_model
from heterog.cost.host import autocast_casts, host_times_s
from heterog.cost.predict import predict, single_device_cluster
from heterog.hardware.catalog import get_gpu, host_costs
from heterog.ir.kinds import Phase


@pytest.fixture(scope="module")
def graph():
    return transformer_graph(layers=2, hidden=256, seq=64, batch=4)


def names(g):
    return [n.name for n in g.nodes]


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_a_step_is_never_faster_than_its_host_time(graph, precision):
    gpu = get_gpu("H200")
    cl = single_device_cluster(gpu)
    m = build_cost_model(graph, cl, precision=precision)
    casts = autocast_casts(graph, precision)
    for phase in Phase:
        host = host_times_s(graph, host_costs(gpu), phase, casts)
        for b in (1, 4, 64, 4096):
            per_node = m.node_times_s(names(graph), cl.devices[0].name, b, phase)
            assert np.all(per_node >= host - 1e-15)
            assert per_node.sum() >= host.sum()
    # small batches are host-bound: the step does not get faster below some batch
    t1, t2 = (predict(graph, batch_size=b, device=gpu, precision=precision)["iteration_time_s"] for b in (1, 2))
    assert t2 == pytest.approx(t1, rel=0.02)


def test_a_slower_host_slows_small_steps_but_not_large_ones(graph):
    gpu = get_gpu("H200")
    slow = dataclasses.replace(
        gpu,
        host=dataclasses.replace(
            host_costs(gpu),
            forward_node_s=10 * host_costs(gpu).forward_node_s,
            backward_op_s=10 * host_costs(gpu).backward_op_s,
        ),
    )
    small = [predict(graph, batch_size=1, device=g)["iteration_time_s"] for g in (gpu, slow)]
    big = [predict(graph, batch_size=1 << 16, device=g)["iteration_time_s"] for g in (gpu, slow)]
    assert small[1] > 3 * small[0]
    assert big[1] == pytest.approx(big[0], rel=0.05)


def test_autocast_adds_its_casts(graph):
    assert autocast_casts(graph, "fp32") is None
    casts = autocast_casts(graph, "amp-bf16")
    kinds = [n.kind for n in graph.nodes]
    from heterog.cost.memory import forced_fp32

    for i, n in enumerate(graph.nodes):
        if n.kind not in ("matmul", "conv", "attention") and not forced_fp32(n):
            assert casts.count[i] == 0
    # blocks.0.attn.qkv: weight + bias, and its input comes from a layer norm (fp32 under autocast)
    i = graph.index["blocks.0.attn.qkv"]
    assert casts.count[i] == 3
    assert casts.bytes_fixed[i] == pytest.approx(1.5 * graph.nodes[i].param_bytes)
    assert casts.bytes_per_sample[i] > 0
    # mlp.fc2 reads the GELU output, half under autocast: only its weight and bias are cast
    assert casts.count[graph.index["blocks.0.mlp.fc2"]] == 2
    # the host pays for each cast, forward and backward
    h = host_costs(get_gpu("H200"))
    for phase in Phase:
        extra = host_times_s(graph, h, phase, casts) - host_times_s(graph, h, phase, None)
        assert extra == pytest.approx(h.autocast_cast_s * casts.count)
    assert "matmul" in kinds


def test_a_power_limited_card_sustains_less_than_its_peak():
    """The T4 (70 W) and L4 (72 W) sustain a smaller share of their data-sheet tensor peak
    than full-power cards of their generations (Titan RTX, 280 W; RTX 4090, 450 W) on the same
    layer (hidden 2048, 4k tokens): their GEMMs hold the base clock, far below the boost clock
    the peak assumes (hardware/public_model.py). No type passes its data-sheet peak."""
    big = transformer_graph(layers=1, hidden=2048, seq=512, batch=8)

    def share(name: str) -> float:
        gpu = get_gpu(name)
        r = predict(big, batch_size=8, device=gpu, precision="fp16")
        return r["flops_per_iteration"] / r["iteration_time_s"] / gpu.peak_flops_per_s["fp16"]

    for card, full_power in (("T4", "Titan-RTX"), ("L4", "RTX-4090")):
        assert share(card) < 0.75 * share(full_power)
    assert all(share(n) <= 1.0 for n in ("T4", "RTX-2080Ti", "RTX-3090", "A100-80GB", "H100-SXM"))


def test_every_catalog_type_names_the_source_of_its_efficiency():
    from heterog.hardware.catalog import list_gpus

    for g in list_gpus():
        e = g.efficiency
        assert e.source, f"{g.name}: efficiency without a source"
        if e.inherits:
            get_gpu(e.inherits)  # a stated sibling that exists


def test_a_cudnn_call_costs_the_host_more_than_an_ordinary_op(graph):
    """Convolutions (every NVIDIA GPU) and half-precision attention on Hopper go through
    cuDNN's frontend: the host pays cudnn_op_s more for each, forward and backward."""
    from heterog.cost.host import cudnn_calls

    conv = conv_graph()
    h200, a100, mi300 = get_gpu("H200"), get_gpu("A100-80GB"), get_gpu("MI300X")
    assert list(cudnn_calls(conv, "fp32", h200)) == [1.0, 0.0]
    assert not cudnn_calls(conv, "fp32", mi300).any()  # MIOpen, not cuDNN
    attn = [n.kind == "attention" for n in graph.nodes]
    assert list(cudnn_calls(graph, "amp-bf16", h200) > 0) == attn
    assert not cudnn_calls(graph, "fp32", h200).any()  # fp32 attention: not cuDNN
    assert not cudnn_calls(graph, "amp-bf16", a100).any()  # Ampere: flash attention
    h = host_costs(h200)
    assert h.cudnn_op_s > 3 * h.forward_op_s  # a cuDNN call is expensive
    for phase in Phase:
        with_cudnn = host_times_s(conv, h, phase, None, cudnn_calls(conv, "fp32", h200))
        assert with_cudnn - host_times_s(conv, h, phase, None) == pytest.approx([h.cudnn_op_s, 0.0])
        # and the model's node time is never below that host time
        m = build_cost_model(conv, single_device_cluster(h200), precision="fp32")
        assert m.compute_time_s("conv1", "local/gpu0", 1, phase) >= with_cudnn[0]


def test_the_cudnn_host_cost_is_one_figure_across_models():
    """Measured on the H200 per-op profiles (h200_steps.json): resnet50's convolutions and
    gpt2-medium's bf16 attention cost the host the same extra per cuDNN call within 15%;
    bert-large's fp32 profile has no cuDNN op."""
    import json
    from importlib import resources

    from heterog.cost.calibrate import cudnn_op_host_s

    doc = json.loads(resources.files("heterog.cost").joinpath("data", "h200_steps.json").read_text())
    prof = {p["name"]: p for p in doc["op_profiles"]}
    conv_s, attn_s = cudnn_op_host_s([prof["resnet50"]]), cudnn_op_host_s([prof["gpt2_medium"]])
    assert 40e-6 < conv_s < 200e-6 and 40e-6 < attn_s < 200e-6
    assert conv_s == pytest.approx(attn_s, rel=0.15)
    assert cudnn_op_host_s([prof["bert_large"]]) is None


def test_autocast_casts_the_half_inputs_of_its_fp32_list_ops(graph):
    """An op on autocast's fp32 list (layer norm, loss, pow) casts each half input up to fp32
    (gpt2-medium's bf16 profile has 777 casts a step; the matmul-side casts alone are 628 of
    the model's): one cast each, 2 B read and 4 B written per element, forward and back."""
    casts = autocast_casts(graph, "amp-bf16")
    first_ln = graph.index["blocks.0.ln1"]  # reads the fp32 graph input: no cast
    assert casts.count[first_ln] == 0
    ln2 = graph.index["blocks.0.ln2"]  # reads attn.proj's half output
    edge = next(e for e in graph.edges if e.dst == "blocks.0.ln2")
    assert casts.count[ln2] == 1
    assert casts.bytes_per_sample[ln2] == pytest.approx(1.5 * edge.bytes.per_sample)
    assert casts.count[graph.index["root::cross_entropy@0"]] == 1  # the head's half logits
    assert autocast_casts(graph, "fp32") is None


def test_the_cast_host_cost_is_measured_on_the_half_precision_profile():
    """aten::to in gpt2-medium's bf16 step profile (h200_steps.json): 777 calls, 18.1 µs each
    (children included); the fp32 profiles hold no autocast cast."""
    import json
    from importlib import resources

    from heterog.cost.calibrate import cast_op_host_s

    doc = json.loads(resources.files("heterog.cost").joinpath("data", "h200_steps.json").read_text())
    prof = {p["name"]: p for p in doc["op_profiles"]}
    assert cast_op_host_s([prof["gpt2_medium"]]) == pytest.approx(18.1e-6, rel=0.01)
    assert cast_op_host_s([prof["resnet50"], prof["bert_large"]]) is None
    assert cast_op_host_s(list(prof.values())) == pytest.approx(18.1e-6, rel=0.01)


def test_a_half_precision_nchw_convolution_pays_for_its_layout_transforms():
    """Under amp-bf16/fp16 a convolution (NCHW) moves each activation in and out of NHWC:
    2 extra passes of its activation traffic at copy bandwidth, forward and backward; fp32
    and non-NVIDIA types do not."""
    from heterog.cost.roofline import NCHW_HALF_CONV_TRANSFORM_PASSES, TypeTable
    from heterog.hardware.efficiency import memory_efficiency

    conv = conv_graph()
    gpu = get_gpu("H200")
    for phase, obj in ((Phase.FORWARD, conv.nodes[0].fwd_bytes), (Phase.BACKWARD, conv.nodes[0].bwd_bytes)):
        half = TypeTable(conv, gpu, "amp-bf16", phase)
        extra_s = (
            NCHW_HALF_CONV_TRANSFORM_PASSES
            * 0.5
            * obj.per_sample
            * 256
            / (gpu.memory_bandwidth_bytes_per_s * memory_efficiency(gpu))
        )
        bare = TypeTable(conv, gpu, "amp-bf16", phase)
        bare.transform_ps = np.zeros(2)
        idx = np.array([0, 1])
        assert half.times_s(idx, 256)[0] - bare.times_s(idx, 256)[0] == pytest.approx(extra_s)
        assert half.times_s(idx, 256)[1] == bare.times_s(idx, 256)[1]  # the ReLU: none
        assert not TypeTable(conv, gpu, "fp32", phase).transform_ps.any()
        assert not TypeTable(conv, get_gpu("MI300X"), "amp-bf16", phase).transform_ps.any()


def test_the_half_precision_convolution_factor_scales_only_half_convolutions():
    """efficiency.conv[p] (fitted on resnet50's amp-bf16 steps) slows or speeds cuDNN
    convolutions at bf16/fp16 only: not matmuls, not fp32 (TF32) convolutions; it survives
    a saved cluster's round trip; and it only takes half precisions."""
    from heterog.hardware.gputype import Efficiency, gpu_extras_from_dict, gpu_extras_to_dict

    conv, tf = conv_graph(), transformer_graph(layers=1, hidden=256, seq=64, batch=4)
    catalog = get_gpu("H200")
    h200 = dataclasses.replace(catalog, efficiency=dataclasses.replace(catalog.efficiency, conv={}))
    slow = dataclasses.replace(catalog, efficiency=dataclasses.replace(catalog.efficiency, conv={"bf16": 0.25}))

    def device_s(g, gpu, precision, node):
        m = build_cost_model(g, single_device_cluster(gpu), precision=precision)
        return m.compute_time_s(node, "local/gpu0", 4096, Phase.FORWARD)

    assert device_s(conv, slow, "amp-bf16", "conv1") > 1.5 * device_s(conv, h200, "amp-bf16", "conv1")
    assert device_s(conv, slow, "fp32", "conv1") == device_s(conv, h200, "fp32", "conv1")
    assert device_s(tf, slow, "amp-bf16", "blocks.0.mlp.fc1") == device_s(tf, h200, "amp-bf16", "blocks.0.mlp.fc1")
    assert gpu_extras_from_dict(gpu_extras_to_dict(slow))["efficiency"].conv == {"bf16": 0.25}
    with pytest.raises(ValueError, match="bf16 or fp16"):
        Efficiency(conv={"tf32": 0.5})
