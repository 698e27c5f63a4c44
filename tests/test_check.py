"""`heterog check --device meta`: every rank's stages built for a device other than the CPU the
model was exported on, and every compute instruction run there, for each model family under
the four kinds of plan — and a stage with a CPU-pinned node or a stale buffer is refused
with the node's or buffer's name.

meta stands in for a GPU here: a stage built for meta fails where a tensor, buffer or graph
node is pinned to the CPU, as one built for CUDA would. Small configurations of the zoo's
families; one model build and export per family (BuildCache), shared by its four plans.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from heterog.capture import capture_model
from heterog.execute import placement
from heterog.execute.check import BuildCache
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.orchestrate import check

SEQ = 8
FAMILIES = {  # model → (args, batch size)
    "mobilenet_v2": (dict(num_classes=10), 6),  # CNN with BatchNorm buffers
    "transformer": (dict(vocab=96, d_model=32, heads=4, layers=1, ffn=64, dropout=0.0), 6),  # seq2seq
    "bert-large": (dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96, positions=32), 6),
    "xlnet-large": (dict(hidden=32, layers=2, heads=4, ffn=64, vocab=96), 6),
    "gpt2": (dict(hidden=32, layers=2, heads=4, vocab=96, positions=32), 6),
    "llama": (dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=96, positions=32), 6),
}
CACHE = BuildCache()


@functools.cache
def _halves(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    args, _ = FAMILIES[name]
    nodes = [n.name for n in capture_model(name, args, batch_size=2, seq_len=SEQ).nodes]
    k = len(nodes) // 2
    return tuple(nodes[:k]), tuple(nodes[k:])


def _plan(name: str, kind: str) -> Plan:
    args, batch = FAMILIES[name]
    a, b = _halves(name)

    def reps(*pairs):
        return tuple(Replica(device=d, share=s) for d, s in pairs)

    if kind == "even-dp":
        groups = [Group(name="all", nodes=a + b, replicas=reps(("a", 0.5), ("b", 0.5)), sync="ring")]
    elif kind == "pipeline-1f1b":
        groups = [
            Group(name="s0", nodes=a, replicas=reps(("a", 1.0))),
            Group(name="s1", nodes=b, replicas=reps(("b", 1.0))),
        ]
    elif kind == "uneven-hybrid":
        groups = [
            Group(name="s0", nodes=a, replicas=reps(("a", 1.0))),
            Group(name="s1", nodes=b, replicas=reps(("b", 2 / 3), ("c", 1 / 3)), sync="ring"),
        ]
    else:  # parameter server on a device without a replica
        groups = [
            Group(name="s0", nodes=a, replicas=reps(("a", 0.5), ("b", 0.5)), sync="ps", ps_device="c"),
            Group(name="s1", nodes=b, replicas=reps(("a", 0.5), ("b", 0.5)), sync="ps", ps_device="c"),
        ]
    return Plan(
        strategy=kind,
        model=ModelSpec(name=name, args=args, batch_size=batch, seq_len=SEQ),
        groups=tuple(groups),
        num_microbatches=2 if kind == "pipeline-1f1b" else 1,
        schedule="1f1b" if kind == "pipeline-1f1b" else "gpipe",
    ).validate()


KINDS = ("even-dp", "pipeline-1f1b", "uneven-hybrid", "parameter-server")


@pytest.mark.parametrize("name", FAMILIES)
def test_every_rank_of_every_plan_kind_runs_on_meta(name):
    for kind in KINDS:
        result = check(_plan(name, kind), device="meta", cache=CACHE)
        assert result.ok, (name, kind, [r.problem for r in result.ranks if r.problem])
        assert result.target == "meta"
        for r in result.ranks:
            assert r.computes_run == r.computes, (name, kind, r)
            assert (r.stages > 0) == (r.computes > 0), (name, kind, r)  # a pure server computes nothing
        assert sum(r.computes for r in result.ranks) > 0
        assert json.loads(json.dumps(result.to_dict()))["ok"] is True


def test_a_cpu_pinned_node_is_named(monkeypatch):
    """Without the device rewrite, GPT-2's stages keep aten.arange(device=cpu) for the position
    ids: the check refuses the rank and names that node and its module."""
    monkeypatch.setattr(placement, "rewrite_node_devices", lambda module, device: 0)
    result = check(_plan("gpt2", "pipeline-1f1b"), device="meta", cache=CACHE)
    assert not result.ok
    problem = result.ranks[0].problem
    assert "arange" in problem and "is on cpu" in problem and "node" in problem, problem


def test_a_stale_buffer_is_named(monkeypatch):
    """A stage that keeps the CPU buffer the model was exported with (BERT's position ids: what
    `Module.to` leaves a stage holding, since it gives the model a new buffer object) is
    refused before it runs, naming the buffer."""
    real = placement.place_stages

    def leave_a_buffer_behind(modules, device):
        modules = list(modules)
        before = [
            (owner, owner._buffers["position_ids"])
            for module in modules
            for owner in module.modules()
            if "position_ids" in owner._buffers
        ]
        replaced = real(modules, device)
        for owner, old in before:
            owner._buffers["position_ids"] = old
        return replaced

    monkeypatch.setattr(placement, "place_stages", leave_a_buffer_behind)
    result = check(_plan("bert-large", "even-dp"), device="meta", cache=CACHE)
    assert not result.ok
    problem = result.ranks[0].problem
    assert "buffer" in problem and "position_ids" in problem and "is on cpu" in problem, problem


def test_check_command_prints_each_rank_and_refuses_an_unknown_device(tmp_path):
    path = tmp_path / "plan.json"
    _plan("gpt2", "uneven-hybrid").save(path)

    def heterog(*argv):
        return subprocess.run(
            [sys.executable, "-m", "heterog.cli.main", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )

    ok = heterog("check", str(path), "--device", "meta", "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and [r["device"] for r in doc["ranks"]] == ["a", "b", "c"]
    assert all(r["computes_run"] == r["computes"] > 0 for r in doc["ranks"])
    bad = heterog("check", str(path), "--device", "tpu")
    assert bad.returncode == 2 and "choose one of meta, cpu, cuda" in " ".join(bad.stderr.split()), bad.stderr
