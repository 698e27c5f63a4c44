"""Megatron tensor parallelism in the cost model: closed forms on a 2-layer GPT-2."""

from __future__ import annotations

import pytest

from heterog.capture import capture_model
from heterog.cost import AnalyticCostModel, comm
from heterog.cost.tensor_parallel import TensorParallelCostModel, group_collectives, megatron_layout, split_graph
from heterog.errors import GraphError, PlanError
from heterog.hardware.spec import parse_cluster_yaml
from heterog.ir.kinds import Phase

B, S, H, LAYERS = 2, 64, 768, 2
CLUSTER = """\
name: two-by-two
nodes:
  - name: a
    nic_bandwidth_gbps: 50
    devices: [{type: T4, count: 2}]
  - name: b
    nic_bandwidth_gbps: 50
    devices: [{type: T4, count: 2}]
"""


@pytest.fixture(scope="module")
def graph():
    return capture_model("gpt2", {"layers": LAYERS}, batch_size=B, seq_len=S)


@pytest.fixture(scope="module")
def cluster():
    return parse_cluster_yaml(CLUSTER)


def tp_costs(graph, cluster, degree: int) -> TensorParallelCostModel:
    names = [d.name for d in cluster.devices]
    groups = {names[i]: names[i : i + degree] for i in range(0, len(names), degree)}
    return TensorParallelCostModel(graph, cluster, degree=degree, groups=groups, precision="fp16", optimizer="adamw")


def test_layout_pairs_column_and_row_linears(graph):
    layout = megatron_layout(graph)
    assert [(r.column, r.row) for r in layout.regions[:2]] == [
        (("transformer.h.0.attn.c_attn",), "transformer.h.0.attn.c_proj"),
        (("transformer.h.0.mlp.c_fc",), "transformer.h.0.mlp.c_proj"),
    ]
    assert len(layout.regions) == 2 * LAYERS
    assert layout.vocab is not None and (layout.vocab.embedding, layout.vocab.head) == ("transformer.wte", "lm_head")


def test_layout_of_a_llama_block():
    """Separate q/k/v and gate/up projections are all column-parallel; the residual path that
    also reads the norm's input stays outside the region."""
    layout = megatron_layout(capture_model("llama", {"layers": 1}, batch_size=2, seq_len=32))
    attn, mlp = layout.regions
    assert [c.rsplit(".", 1)[1] for c in attn.column] == ["q_proj", "k_proj", "v_proj"]
    assert attn.row.endswith("o_proj") and mlp.row.endswith("down_proj")
    assert [c.rsplit(".", 1)[1] for c in mlp.column] == ["gate_proj", "up_proj"]


def test_degree_one_is_the_unsplit_model(graph, cluster):
    one = tp_costs(graph, cluster, 1)
    plain = AnalyticCostModel(graph, cluster, precision="fp16", optimizer="adamw")
    d = cluster.devices[0].name
    names = [n.name for n in graph.nodes]
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert one.group_time_s(names, d, B, phase) == pytest.approx(plain.group_time_s(names, d, B, phase), rel=1e-12)
    assert one.persistent_bytes(names, d) == plain.persistent_bytes(names, d)
    assert one.activation_bytes(names, B) == plain.activation_bytes(names, B)


def test_two_allreduces_of_the_activations_per_block_each_way(graph, cluster):
    """Shoeybi et al. 2019 §3: per block two all-reduces (after attention, after the MLP) in
    forward and two in backward, of batch × seq × hidden elements (fp16: 2 bytes each)."""
    layout = megatron_layout(graph, vocab_parallel=False)
    found = group_collectives(graph, layout, "fp16")
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        mine = [c for c in found if c.phase == phase]
        assert len(mine) == 2 * LAYERS
        assert {c.elements.at(B) * c.element_bytes for c in mine} == {B * S * H * 2}
    # a vocabulary-parallel embedding and head add one each way; the loss three in forward
    vocab = group_collectives(graph, megatron_layout(graph), "fp16")
    assert sum(c.phase == Phase.FORWARD for c in vocab) == 2 * LAYERS + 1 + 3
    assert sum(c.phase == Phase.BACKWARD for c in vocab) == 2 * LAYERS + 1
    # the row linear's forward pays its all-reduce over its group's own devices
    costs = tp_costs(graph, cluster, 2)
    row, d = "transformer.h.1.mlp.c_proj", "a/gpu0"
    split = AnalyticCostModel(costs.graph, cluster, precision="fp16", optimizer="adamw")
    ring = comm.collective_time_s(cluster, "allreduce", B * S * H * 2, ["a/gpu0", "a/gpu1"])
    assert costs.compute_time_s(row, d, B, Phase.FORWARD) == pytest.approx(
        split.compute_time_s(row, d, B, Phase.FORWARD) + ring, rel=1e-9
    )


@pytest.mark.parametrize("degree", [2, 4])
def test_split_layers_hold_a_tth_of_their_state_and_activations(graph, cluster, degree):
    layout = megatron_layout(graph)
    split = split_graph(graph, layout, degree)
    # parameters, gradients and Adam's state of a split linear: 1/t on each rank
    whole = AnalyticCostModel(graph, cluster, precision="fp16", optimizer="adamw")
    rank = AnalyticCostModel(split, cluster, precision="fp16", optimizer="adamw")
    fc, d = ["transformer.h.0.mlp.c_fc"], cluster.devices[0].name
    assert rank.persistent_bytes(fc, d) == pytest.approx(whole.persistent_bytes(fc, d) / degree, rel=1e-3)
    for r in layout.regions:
        for name in (*r.column, r.row):
            assert split.node(name).param_count == pytest.approx(graph.node(name).param_count / degree, abs=1)
            # a column-parallel linear keeps its whole input for backward (Korthikanti et al. 2022)
            kept = graph.node(name).saved_bytes if name in r.column else graph.node(name).saved_bytes.scaled(1 / degree)
            assert split.node(name).saved_bytes == kept
        for name in r.inner:
            assert split.node(name).saved_bytes == graph.node(name).saved_bytes.scaled(1 / degree)
        assert split.node(r.norm) == graph.node(r.norm)  # norms are replicated
    # the smaller GEMM is priced by the roofline at its own size: never faster than 1/t
    assert split.node("transformer.h.0.mlp.c_fc").fwd_flops == graph.node("transformer.h.0.mlp.c_fc").fwd_flops.scaled(
        1 / degree
    )


def test_groups_between_nodes_share_the_nic(graph):
    """Two tensor-parallel groups (one per node) all-reducing their gradients: the two sibling
    rings cross the NICs at once, as one ring of twice the bytes would (NICs slower than the
    T4's PCIe ports, so the NIC is what they share)."""
    cluster = parse_cluster_yaml(CLUSTER.replace("nic_bandwidth_gbps: 50", "nic_bandwidth_gbps: 10"))
    costs = tp_costs(graph, cluster, 2)
    nbytes = 8e6
    assert costs.collective_time_s("allreduce", nbytes, ["a/gpu0", "b/gpu0"]) == pytest.approx(
        comm.collective_time_s(cluster, "allreduce", 2 * nbytes, ["a/gpu0", "b/gpu0"]), rel=1e-9
    )


def test_bad_inputs_say_what_to_fix(graph, cluster):
    with pytest.raises(PlanError, match="must list 2 devices"):
        TensorParallelCostModel(graph, cluster, degree=2, groups={"a/gpu0": ["a/gpu0"]})
    with pytest.raises(PlanError, match="not supported"):
        split_graph(graph, megatron_layout(graph), 3)
    costs = tp_costs(graph, cluster, 2)
    with pytest.raises(PlanError, match="no tensor-parallel group"):
        costs.compute_time_s("transformer.h.0.attn.c_proj", "a/gpu1", B, Phase.FORWARD)
    cnn = capture_model("toy-cnn", batch_size=2)
    with pytest.raises(GraphError, match="Megatron's pattern"):
        megatron_layout(cnn)
