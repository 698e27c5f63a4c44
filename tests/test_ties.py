"""Tied parameters: recorded by the capture, held as copies by every group that reads them.

The end-to-end check (the tied embedding of GPT-2 / the Transformer on three devices,
its gradient summed across them, parameters equal to single-process training) is in
test_execute_split_models.py; here the capture's record, its file format, and that the
executor ties exactly what the capture recorded.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from heterog.capture import capture, capture_model
from heterog.cut.partition import split_model
from heterog.errors import GraphError
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Group, ModelSpec, Plan, Replica

TINY = {
    "transformer": dict(vocab=64, d_model=16, heads=2, layers=1, ffn=32, dropout=0.0),
    "gpt2": dict(hidden=16, layers=1, heads=2, vocab=64, positions=16, dropout=0.0),
    "llama": dict(hidden=16, layers=1, heads=2, ffn=32, vocab=64, positions=16),
}


class Repeat(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.shared(torch.relu(self.shared(x))))


def test_tied_embedding_and_output_projection_are_recorded():
    graph = capture_model("transformer", TINY["transformer"], batch_size=2, seq_len=8)
    assert [(t.param, t.nodes, t.param_bytes) for t in graph.ties] == [
        ("embed.weight", ("embed", "embed#1", "generator"), 64 * 16 * 4)
    ]
    assert "embed.weight" in graph.node("embed").param_names
    assert graph.node("generator").param_count == 0  # the owner holds it once
    gpt2 = capture_model("gpt2", TINY["gpt2"], batch_size=2, seq_len=8)
    assert [(t.param, t.nodes) for t in gpt2.ties] == [("transformer.wte.weight", ("transformer.wte", "lm_head"))]
    assert capture_model("llama", TINY["llama"], batch_size=2, seq_len=8).ties == ()  # untied head


def test_a_module_called_twice_ties_its_parameters_between_the_calls():
    graph = capture(Repeat(), (torch.randn(4, 8),))
    assert {t.param: t.nodes for t in graph.ties} == {
        "shared.weight": ("shared", "shared#1"),
        "shared.bias": ("shared", "shared#1"),
    }


def test_ties_survive_a_round_trip_and_graphs_without_them_keep_their_file_and_fingerprint(tmp_path):
    graph = capture(Repeat(), (torch.randn(4, 8),))
    graph.save(tmp_path / "g.json")
    again = OpGraph.load(tmp_path / "g.json")
    assert again.ties == graph.ties and again.fingerprint() == graph.fingerprint()
    untied = capture(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(4, 8),))
    assert "ties" not in json.loads(untied.to_json())  # the same file as before ties existed
    doc = json.loads(graph.to_json())
    doc["ties"][0][1] = ["shared", "nowhere"]
    with pytest.raises(GraphError, match="no node 'nowhere'"):
        OpGraph.from_json(json.dumps(doc))


def test_tie_holders_are_the_groups_of_the_tied_nodes():
    graph = capture_model("transformer", TINY["transformer"], batch_size=2, seq_len=8)
    group_of = {n.name: (0 if i < 10 else 1) for i, n in enumerate(graph.nodes)}
    assert graph.tie_holders(group_of) == {"embed.weight": (0, 1)}
    assert graph.tie_holders({n.name: 0 for n in graph.nodes}) == {}


@pytest.mark.parametrize("name", ["transformer", "gpt2"])
def test_the_executor_ties_what_the_capture_recorded(name):
    graph = capture_model(name, TINY[name], batch_size=2, seq_len=8)
    names = [n.name for n in graph.nodes]
    k = len(names) // 2
    plan = Plan(
        strategy="t",
        model=ModelSpec(name=name, args=TINY[name], batch_size=4, seq_len=8),
        groups=(
            Group(name="a", nodes=tuple(names[:k]), replicas=(Replica(device="d0", share=1.0),)),
            Group(name="b", nodes=tuple(names[k:]), replicas=(Replica(device="d1", share=1.0),)),
        ),
    )
    from heterog.capture.zoo import get_zoo_model

    model = get_zoo_model(name).build(**TINY[name])
    flow = split_model(model, plan)
    assert flow.tied == graph.tie_holders({n: g for g, grp in enumerate(plan.groups) for n in grp.nodes})
