"""The executor's Megatron split (execute/tp_split.py) pairs the linears as the cost model
does on the captured graph, cuts parameters reversibly, keeps Megatron's operators through
torch.export, and refuses what it cannot split with the reason."""

from __future__ import annotations

import pytest
import torch
from test_shard_execute import MODELS, SEQ
from torch import nn

from heterog.capture import capture_model
from heterog.cost.tensor_parallel import megatron_layout
from heterog.cut.split_export import export_model
from heterog.errors import PlanError
from heterog.execute.tp_ops import NO_COMMUNICATION
from heterog.execute.tp_split import ParameterSlice, TensorParallelRank, region_pairs, split_model
from heterog.ir.plan import ModelSpec
from heterog.workload import build_model, global_batch, resolve_workload

ARGS = {
    **MODELS,
    "bert-large": dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96, positions=32, dropout=0.0),
    "opt-1.3b": dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96, dropout=0.0),
}


def _model(name: str) -> nn.Module:
    return build_model(resolve_workload(ModelSpec(name=name, args=ARGS[name], batch_size=2, seq_len=SEQ)), seed=0)


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt-1.3b"])
def test_module_pairs_agree_with_the_cost_models_layout(name):
    graph = capture_model(name, ARGS[name], batch_size=2, seq_len=SEQ)
    layout = megatron_layout(graph, vocab_parallel=False)
    assert region_pairs(_model(name)) == [(r.norm, r.column, r.row) for r in layout.regions]


def test_only_the_regions_the_cost_model_split_are_split():
    """BERT's first attention reads the embeddings' norm through a dropout, so the graph's layout
    leaves it whole; given the layout's regions (the Program's tp_regions) the executor leaves
    it whole too, and a region it cannot find is refused."""
    graph = capture_model("bert-large", ARGS["bert-large"], batch_size=2, seq_len=SEQ)
    regions = tuple((r.norm, r.column, r.row) for r in megatron_layout(graph, vocab_parallel=False).regions)
    model = _model("bert-large")
    assert len(region_pairs(model)) == len(regions) + 1
    cut = split_model(model, TensorParallelRank(index=0, degree=2, group=NO_COMMUNICATION), regions)
    assert "bert.encoder.layer.0.attention.self.query.weight" not in cut
    assert "bert.encoder.layer.1.attention.self.query.weight" in cut
    with pytest.raises(PlanError, match="does not find.*--tp 1"):
        split_model(_model("gpt2"), TensorParallelRank(index=0, degree=2, group="g"), regions)


def test_a_fused_slice_is_taken_and_assembled_back():
    whole = torch.arange(24.0).reshape(2, 12)  # (in, out) with q, k, v of width 4 each
    sl = ParameterSlice(dim=1, full=12, parts=3)
    pieces = [sl.take(whole, i, 2) for i in range(2)]
    assert pieces[0].tolist()[0] == [0, 1, 4, 5, 8, 9] and pieces[1].shape == (2, 6)
    assert torch.equal(sl.assemble(pieces), whole)


def test_split_gpt2_exports_with_megatrons_operators_and_halves_its_blocks():
    model = _model("gpt2")
    whole = sum(p.numel() for p in model.parameters())
    cut = split_model(model, TensorParallelRank(index=1, degree=2, group=NO_COMMUNICATION))
    attn = model.transformer.h[0].attn
    assert attn.c_attn.weight.shape == (32, 48) and attn.split_size == 16 and attn.c_proj.weight.shape == (16, 32)
    assert set(cut) >= {"transformer.h.0.attn.c_attn.bias", "transformer.h.1.mlp.c_proj.weight"}
    assert sum(p.numel() for p in model.parameters()) < whole
    inputs, _ = global_batch(
        resolve_workload(ModelSpec(name="gpt2", args=MODELS["gpt2"], batch_size=2, seq_len=SEQ)), 2, seed=0, step=0
    )
    exported = export_model(model, inputs)
    ops = [str(n.target) for n in exported.module.graph.nodes if n.op == "call_function"]
    assert ops.count("heterog.tp_copy.default") == 4 and ops.count("heterog.tp_reduce.default") == 4
    owners = {exported.leaf_name.get(n) for n in exported.module.graph.nodes if "tp_" in str(n.target)}
    assert owners == {f"transformer.h.{b}.{m}" for b in (0, 1) for m in ("ln_1", "ln_2", "attn.c_proj", "mlp.c_proj")}


def test_split_refuses_what_it_cannot_divide_or_find():
    with pytest.raises(PlanError, match="2 key/value heads.*degree 4"):
        split_model(_model("llama"), TensorParallelRank(index=0, degree=4, group=NO_COMMUNICATION))
    with pytest.raises(PlanError, match="finds no transformer block.*--tp 1"):
        split_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), TensorParallelRank(index=0, degree=2, group="g"))
