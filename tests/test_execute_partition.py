"""Splitting a model by a Plan's groups (in-process, no ranks)."""

from __future__ import annotations

import pytest
import torch
from test_execute_models import MLP, Branchy, Repeat, ResMLP, TinyVGG

from heterog.cut.partition import build_dataflow, fx_node_names, split_model
from heterog.errors import PlanError
from heterog.ir.plan import Group, ModelSpec, Plan, Replica

VEC = (torch.randn(8, 16),)  # an example batch to export the vector models with


def _plan(groups, batch_size=8, microbatches=1) -> Plan:
    return Plan(
        strategy="t",
        model=ModelSpec(name="m", batch_size=batch_size),
        groups=tuple(groups),
        num_microbatches=microbatches,
    )


def _g(name, nodes, *devs, sync="ring"):
    share = 1.0 / len(devs)
    return Group(
        name=name,
        nodes=tuple(nodes),
        replicas=tuple(Replica(device=d, share=share) for d in devs),
        sync=sync if len(devs) > 1 else "none",
    )


def _run_stages(flow, *inputs):
    """Evaluate the split dataflow in one process; must equal the unsplit model."""
    env = dict(zip(flow.inputs, inputs))
    for s in flow.stages:
        env[s.value] = s.module(
            *[env[a] if a in env else env[flow.projections[a][0]][flow.projections[a][1]] for a in s.args]
        )
        for proj, (src, idx) in flow.projections.items():
            if src == s.value:
                env[proj] = env[src][idx]
    return env[flow.output]


def test_node_names_follow_capture_naming_with_repeat_suffix():
    assert fx_node_names(MLP()) == ["fc1", "act1", "fc2", "act2", "fc3"]
    assert fx_node_names(Repeat()) == ["shared", "shared#1", "head"]
    assert fx_node_names(TinyVGG())[:2] == ["features.0", "features.1"]


def test_loose_ops_follow_their_latest_producer_and_split_is_exact():
    model = ResMLP()
    plan = _plan([_g("a", ["inp", "block.0"], "d0"), _g("b", ["block.1", "out"], "d1")])
    flow = split_model(model, plan, VEC)
    # inp, block.0 | block.1 (Tanh), then the residual add and .relu(): the add's operands come
    # from groups a and b, so it runs in b, the later one; no group on both sides of another
    assert [s.group for s in flow.stages] == [0, 1]
    x = torch.randn(8, 16)
    assert torch.allclose(_run_stages(flow, x), model(x))
    names = {g: sorted(n for n, _ in ps) for g, ps in flow.params_of_group.items()}
    assert names == {0: ["block.0.bias", "block.0.weight", "inp.bias", "inp.weight"], 1: ["out.bias", "out.weight"]}


def test_interleaved_groups_become_consecutive_stages():
    # a → b → a: each run of one placement is its own stage; no cycle between stages.
    model = MLP()
    plan = _plan([_g("a", ["fc1", "act1", "fc3"], "d0"), _g("b", ["fc2", "act2"], "d1")])
    flow = split_model(model, plan, VEC)
    assert [s.group for s in flow.stages] == [0, 1, 0]
    x = torch.randn(8, 16)
    assert torch.allclose(_run_stages(flow, x), model(x))


def test_groups_with_one_placement_merge_into_one_stage():
    model = MLP()
    plan = _plan([_g("a", ["fc1", "act1"], "d0", "d1"), _g("b", ["fc2", "act2", "fc3"], "d0", "d1")])
    flow = split_model(model, plan, VEC)
    assert len(flow.stages) == 1
    assert sorted(flow.params_of_group) == [0, 1]  # still synchronised per group


def test_module_called_in_two_groups_is_a_tied_parameter_held_by_both():
    model = Repeat()
    plan = _plan([_g("a", ["shared"], "d0"), _g("b", ["shared#1", "head"], "d1")])
    flow = split_model(model, plan, VEC)
    assert flow.tied == {"shared.weight": (0, 1), "shared.bias": (0, 1)}
    held = {g: [n for n, _ in ps] for g, ps in flow.params_of_group.items()}
    assert held == {
        0: ["shared.weight", "shared.bias"],
        1: ["shared.weight", "shared.bias", "head.weight", "head.bias"],
    }
    x = VEC[0]
    assert torch.allclose(_run_stages(flow, x), model(x))


def test_plan_for_another_model_is_rejected():
    plan = _plan([_g("a", ["conv1", "conv2"], "d0")])
    with pytest.raises(PlanError, match="different model"):
        split_model(MLP(), plan, VEC)


def test_untraceable_model_runs_unsplit_only_under_data_parallelism():
    dp = _plan([_g("a", ["fc1"], "d0", "d1"), _g("b", ["fc2"], "d0", "d1")])
    flow = build_dataflow(Branchy(), dp, 1, VEC)
    assert not flow.split and len(flow.stages) == 1
    assert {g: [n for n, _ in ps] for g, ps in flow.params_of_group.items()} == {
        0: ["fc1.weight", "fc1.bias"],
        1: ["fc2.weight", "fc2.bias"],
    }
    mp = _plan([_g("a", ["fc1"], "d0"), _g("b", ["fc2"], "d1")])
    with pytest.raises(PlanError, match="cannot be exported.*data parallelism"):
        build_dataflow(Branchy(), mp, 1, VEC)


def test_user_data_replaces_synthetic_batches_step_by_step():
    from test_execute_models import fixed_vectors

    from heterog.workload import global_batch, resolve_workload, with_data

    work = with_data(
        resolve_workload(ModelSpec(name="tests/test_execute_models.py:mlp", batch_size=4)),
        "tests/test_execute_models.py:fixed_vectors",
    )
    for step in (0, 3):
        (x,), y = global_batch(work, 4, seed=0, step=step)
        (want,), want_y = fixed_vectors(4, step)
        assert torch.equal(x, want) and torch.equal(y, want_y)


class _TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.left = torch.nn.Linear(16, 8)
        self.right = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.cat([self.left(x), self.right(x)], 1))


def test_plan_priorities_order_independent_stages():
    groups = [_g("l", ["left"], "d0"), _g("r", ["right"], "d1"), _g("h", ["head"], "d0")]
    plain = split_model(_TwoBranch(), _plan(groups), VEC)
    assert [s.group for s in plain.stages][:2] == [0, 1]
    from dataclasses import replace

    ranked = replace(_plan(groups), priorities={"left": 1.0, "right": 5.0, "head": 0.0})
    flow = split_model(_TwoBranch(), ranked, VEC)
    order = [s.group for s in flow.stages]
    # in the plan's group order the cat joins 'r' (its later operand), so 'r' waits for 'l'
    assert order == [0, 1, 2], order
    x = torch.randn(8, 16)
    model = _TwoBranch()
    assert torch.allclose(_run_stages(split_model(model, ranked, VEC), x), model(x))
    # in the Program's order (right first, by priority) the cat joins 'l', the later one there
    by_program = split_model(model, ranked, VEC, group_order=[1, 0, 2])
    # ('l' and 'h' then run back to back on d0: one stage)
    assert [s.groups for s in by_program.stages] == [(1,), (0, 2)]
    assert torch.allclose(_run_stages(by_program, x), model(x))


class _BatchScaled(torch.nn.Module):
    """A statistic over the batch (no sample dimension, needs a gradient) read by a module."""

    class Mean(torch.nn.Module):
        def forward(self, h):
            return h.mean(0, keepdim=True)

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 8)
        self.stat = self.Mean()
        self.scale = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h * self.scale(self.stat(h)))


def test_a_batch_statistic_cannot_cross_placements_and_the_planner_is_told():
    from heterog.cut.split_export import cut_constraints

    # the statistic feeds 'scale'; scale's output (no samples either) meets inp's in a loose mul
    assert cut_constraints(_BatchScaled(), VEC).same_placement == {("stat", "scale"), ("scale", "inp")}
    apart = _plan([_g("a", ["inp", "stat"], "d0", "d1"), _g("b", ["scale", "out"], "d2")])
    with pytest.raises(PlanError, match="no sample dimension.*'stat' and 'scale'"):
        split_model(_BatchScaled(), apart, VEC)
    together = _plan([_g("a", ["inp", "stat"], "d0", "d1"), _g("b", ["scale", "out"], "d0", "d1")])
    model = _BatchScaled()
    assert torch.allclose(_run_stages(split_model(model, together, VEC), VEC[0]), model(VEC[0]))


SMALL = {
    "gpt2": dict(hidden=16, layers=1, heads=2, vocab=64, positions=16, dropout=0.0),
    "bert-large": dict(hidden=16, layers=1, heads=2, ffn=32, vocab=64, positions=16, dropout=0.0),
    "llama": dict(hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, vocab=64, positions=16),
    "xlnet-large": dict(hidden=16, layers=1, heads=2, ffn=32, vocab=64, dropout=0.0),
    "transformer": dict(vocab=64, d_model=16, heads=2, layers=1, ffn=32, dropout=0.0),
    "toy-cnn": {},
}


@pytest.mark.parametrize("name", list(SMALL))
def test_every_exported_leaf_call_is_a_captured_node_and_any_cut_runs(name):
    """The export names its nodes like the capture, and a cut after every third of the
    captured nodes (three stages, the middle one replicated with uneven shares) computes the
    unsplit model's output: seq-first XLNet, rotary tables, position ids and masks included."""
    from heterog.capture import capture_model
    from heterog.capture.zoo import get_zoo_model
    from heterog.cut.split_export import leaf_call_names

    entry = get_zoo_model(name)
    seq = 8 if entry.default_seq_len else None
    nodes = [n.name for n in capture_model(name, SMALL[name], batch_size=2, seq_len=seq).nodes]
    torch.manual_seed(0)
    model = entry.build(**SMALL[name])
    inputs, _ = entry.example_batch(3, seq, "cpu", **SMALL[name])
    assert set(leaf_call_names(model, inputs)) <= set(nodes)
    k = len(nodes) // 3
    plan = Plan(
        strategy="t",
        model=ModelSpec(name=name, args=SMALL[name], batch_size=3, seq_len=seq),
        groups=(_g("a", nodes[:k], "d0"), _g("b", nodes[k : 2 * k], "d1", "d2"), _g("c", nodes[2 * k :], "d0")),
    )
    flow = split_model(model, plan, inputs)
    assert len(flow.stages) >= 3
    want = model(*inputs)
    assert torch.allclose(_run_stages(flow, *inputs), getattr(want, "logits", want), atol=1e-6)
