"""Tensor-parallel plans: the Plan's members, the 3d strategy, the simulator's pricing, and the
refusal of what cannot run them yet."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import types

import pytest
from typer.testing import CliRunner

from heterog.capture import capture_model
from heterog.cli.main import app
from heterog.cost.tensor_parallel import TensorParallelCostModel
from heterog.errors import PlanError
from heterog.hardware.spec import load_cluster
from heterog.inputs import model_inputs
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.lower.program import Compute
from heterog.lower.tensor_parallel import runnable
from heterog.orchestrate import lowered
from heterog.search import three_d
from heterog.search.three_d import best_uniform, grid, megatron_3d
from heterog.simulate.simulator import simulate

B, S = 8, 32
BLOCK = re.compile(r"\.(?:h|layers)\.(\d+)\b")  # the block index in a node's name (HF GPT-2, Llama)


def blocks_of(group: Group) -> set[str]:
    return {m.group(1) for n in group.nodes if (m := BLOCK.search(n))}


SMALL = ModelSpec(name="gpt2", args={"layers": 4}, batch_size=B, seq_len=S)


@pytest.fixture(scope="module")
def small():
    """gpt2 (12 heads, hidden 768) with 4 blocks on paper-8gpu (4 nodes × 2 GPUs)."""
    graph = capture_model("gpt2", dict(SMALL.args), batch_size=B, seq_len=S)
    return model_inputs(SMALL, load_cluster("paper-8gpu"), graph=graph)


def _3d(inputs, **kw):
    graph, cluster, _ = inputs
    return megatron_3d(graph, cluster, model_spec=kw.pop("spec", SMALL), **kw)


def test_members_survive_json_and_older_plans_load(small):
    plan = _3d(small, tp=2, pp=2, dp=2, microbatches=2)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert [r.members for r in again.groups[0].replicas] == [("v100/gpu0", "v100/gpu1"), ("gtx0/gpu0", "gtx0/gpu1")]
    doc = {"kind": "heterog.Plan", "version": 2, **_3d(small, tp=1, pp=2, dp=2).to_dict()}
    old = Plan.from_dict(doc)
    assert not old.tensor_parallel and old.groups[0].tp_degree == 1


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([("b",), ("a",)], "appears twice"),
        ([("c",), ()], r"degrees \[1, 2\]"),
        ([("c", "e"), ("d", "f")], "degree 3 is not supported"),
    ],
)
def test_group_refuses_bad_members(members, why):
    replicas = tuple(
        Replica(device=d, share=0.5, tp_devices=tuple(m)) for d, m in zip(("a", "b"), members, strict=True)
    )
    with pytest.raises(PlanError, match=why):
        Group(name="g", nodes=("n",), replicas=replicas, sync="ring").validate()


def test_3d_plan_places_ranks_in_megatrons_order(small):
    graph, cluster, _ = small
    plan = _3d(small, tp=2, pp=2, dp=2, stage_layers=[1, 3], microbatches=4, zero=1)
    names = [d.name for d in cluster.devices]
    for s, g in enumerate(plan.groups):  # rank = (stage · dp + replica) · tp + tensor rank
        assert [list(r.members) for r in g.replicas] == [names[(s * 2 + j) * 2 : (s * 2 + j + 1) * 2] for j in (0, 1)]
        assert g.shard_stage == 1 and g.sync == "ring"
    assert [blocks_of(g) for g in plan.groups] == [{"0"}, {"1", "2", "3"}]
    assert plan.groups[0].nodes[0] == graph.nodes[0].name and plan.groups[1].nodes[-1] == graph.nodes[-1].name


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"tp": 8, "pp": 1, "dp": 1}, "does not divide its 12 attention heads"),
        ({"tp": 2, "pp": 2, "dp": 4}, "16 devices, but cluster"),
        ({"tp": 2, "pp": 2, "dp": 2, "stage_layers": [2, 1]}, "summing to the model's 4 blocks"),
        ({"tp": 2, "pp": 3, "dp": 1}, "--pp 3 does not divide"),
        ({"tp": 2, "pp": 1, "dp": 2, "devices": ["v100/gpu0"]}, "names 1 devices"),
        ({"tp": 1, "pp": 1, "dp": 1, "zero": 2}, "needs --dp ≥ 2"),
    ],
)
def test_3d_refuses_impossible_combinations(small, kw, why):
    with pytest.raises(PlanError, match=why):
        _3d(small, **kw)


def test_simulator_prices_a_tp_plan_as_the_cost_model_of_its_first_ranks(small):
    """The plan with members equals the first-rank plan on the split graph under
    TensorParallelCostModel (what benchmarks/amp_iterations.py simulates); every member
    gets its first rank's memory and times."""
    graph, cluster, costs = small
    plan = _3d(small, tp=2, pp=2, dp=2, microbatches=2)
    sim = simulate(graph, cluster, plan, costs)
    groups = {r.device: r.members for g in plan.groups for r in g.replicas}
    tp = TensorParallelCostModel(graph, cluster, degree=2, groups=groups, vocab_parallel=False)
    first = dataclasses.replace(
        plan,
        groups=tuple(
            dataclasses.replace(g, replicas=tuple(dataclasses.replace(r, tp_devices=()) for r in g.replicas))
            for g in plan.groups
        ),
        graph_fingerprint="",
    )
    ref = simulate(tp.graph, cluster, first, tp)
    assert sim.iteration_time_s == ref.iteration_time_s
    assert set(sim.peak_memory_bytes) == set(plan.devices()) and len(plan.devices()) == 8
    assert sim.peak_memory_bytes["v100/gpu1"] == ref.peak_memory_bytes["v100/gpu0"]
    unsplit = simulate(graph, cluster, _3d(small, tp=1, pp=2, dp=2, microbatches=2), costs)
    assert sim.peak_memory_bytes["v100/gpu0"] < unsplit.peak_memory_bytes["v100/gpu0"]  # a slice of the blocks
    assert {e.track for e in sim.events} >= set(plan.devices())
    tp_events = [e for e in sim.events if e.category == "tp"]  # each compute's all-reduces, on every member
    assert {e.track for e in tp_events} == set(plan.devices()) and all(e.end_s > e.start_s for e in tp_events)
    assert sim.communication_time_s["v100/gpu1"] > ref.communication_time_s["v100/gpu0"]  # + its all-reduces


def test_a_group_cutting_a_block_is_refused(small):
    graph, cluster, costs = small
    plan = _3d(small, tp=2, pp=2, dp=1)
    a, b = plan.groups
    cut = a.nodes.index("transformer.h.1.attn.c_proj")
    moved = (dataclasses.replace(a, nodes=a.nodes[:cut]), dataclasses.replace(b, nodes=a.nodes[cut:] + b.nodes))
    with pytest.raises(PlanError, match="must hold each column-parallel linear with its row-parallel partner"):
        simulate(graph, cluster, dataclasses.replace(plan, groups=moved, graph_fingerprint=""), costs)


def test_tp_plans_lower_to_every_members_instructions(small):
    """Each member runs its first rank's instructions (its sibling's blocks, ops and tags
    offset), the Program validates, and the prediction names every member's instructions;
    stages of different degrees are refused with the reason."""
    graph, cluster, costs = small
    plan = _3d(small, tp=2, pp=2, dp=2, microbatches=2)
    done = lowered(plan, cluster, graph=graph)
    prog = done.program
    assert set(prog.devices) == set(plan.devices()) and len(prog.blocks) % 2 == 0
    firsts = {r.device: r.members for g in plan.groups for r in g.replicas}
    for lead, (_, member) in firsts.items():
        mine, theirs = prog.instructions[lead], prog.instructions[member]
        assert [type(i) for i in mine] == [type(i) for i in theirs]
        assert {i.op for i in mine}.isdisjoint(i.op for i in theirs)
        computes = [(i.phase, i.microbatch, i.lo, i.hi) for i in mine if isinstance(i, Compute)]
        assert computes == [(i.phase, i.microbatch, i.lo, i.hi) for i in theirs if isinstance(i, Compute)]
    events = {(e.op, e.track) for e in done.sim.events}
    assert all((i.op, d) in events for d, lst in prog.instructions.items() for i in lst)
    mixed = _3d(small, tp=[2, 1], pp=2, dp=1)
    with pytest.raises(PlanError, match=r"degrees \[1, 2\].*same --tp"):
        runnable(mixed, "heterog run")


@pytest.mark.parametrize(
    ("model", "cluster", "kw", "layers"),
    [
        ("gpt2-medium", "paper-8gpu", {"tp": 2, "pp": 2, "dp": 2}, [12, 12]),
        ("llama-7b", "mixed-64", {"tp": 8, "pp": 4, "dp": 1}, [8, 8, 8, 8]),
        ("gpt2-xl", "mixed-16", {"tp": 1, "pp": 4, "dp": 2, "stage_layers": [11, 13, 13, 11]}, [11, 13, 13, 11]),
    ],
)
def test_3d_reproduces_megatron_configurations(model, cluster, kw, layers):
    """Megatron-style configurations of three zoo models: stages of whole blocks, each
    tensor-parallel set on consecutive devices of one node, simulated and fitting."""
    spec = ModelSpec(name=model, batch_size=8, seq_len=64)
    graph = capture_model(model, {}, batch_size=8, seq_len=64)
    inputs = model_inputs(spec, load_cluster(cluster), graph=graph)
    plan = megatron_3d(inputs[0], inputs[1], model_spec=spec, microbatches=2, **kw)
    assert [len(blocks_of(g)) for g in plan.groups] == layers
    for g in plan.groups:
        for r in g.replicas:
            assert len({inputs[1].node_of[d] for d in r.members}) == 1
    sim = simulate(*inputs[:2], plan, inputs[2])
    assert sim.feasible and sim.iteration_time_s > 0


def test_cli_writes_3d_plans_and_check_refuses_them(tmp_path):
    out = tmp_path / "p.json"
    base = ["plan", "--model", "gpt2", "--model-arg", "layers=4", "--batch-size", "8", "--seq-len", "32"]
    res = CliRunner().invoke(
        app,
        [
            *base,
            "--cluster",
            "paper-8gpu",
            "--strategy",
            "3d",
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "2",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert Plan.load(out).groups[1].tp_degree == 2
    res = CliRunner().invoke(app, ["simulate", str(out)])  # every member's row, its all-reduces in comm
    assert res.exit_code == 0, res.output
    assert "v100/gpu1" in res.output and "p100/gpu1" in res.output
    res = CliRunner().invoke(app, ["check", str(out)])  # every member's split stages, on meta
    assert res.exit_code == 0, res.output
    assert "p100/gpu1" in res.output
    res = CliRunner().invoke(app, [*base, "--cluster", "paper-8gpu", "--tp", "2"])
    assert res.exit_code != 0 and "add --strategy 3d" in res.output + str(res.exception)
    grid_out = tmp_path / "grid.json"
    res = CliRunner().invoke(
        app, [*base, "--cluster", "paper-8gpu", "--strategy", "megatron-3d", "--out", str(grid_out)]
    )
    assert res.exit_code == 0, res.output
    assert Plan.load(grid_out).strategy == "megatron-3d" and "megatron-3d: best of" in " ".join(res.output.split())


def test_stages_of_different_degrees(small):
    """A small Llama (untied head) with a 4-way first stage and a 2-way second: each stage's
    ranks hold their own slice, so the second stage holds what it holds in the uniform 2-way
    plan on the same devices, the first half of that; GPT-2's tied embedding and head, kept
    whole by the executor's split, may lie in stages of different degrees."""
    spec = ModelSpec(name="llama", batch_size=B, seq_len=S)
    graph = capture_model("llama", {}, batch_size=B, seq_len=S)
    inputs = model_inputs(spec, load_cluster("paper-8gpu"), graph=graph)
    gtx = ["gtx0/gpu0", "gtx0/gpu1", "gtx1/gpu0", "gtx1/gpu1"]
    mixed = _3d(inputs, spec=spec, tp=[4, 2], pp=2, dp=1, devices=[*gtx, "p100/gpu0", "p100/gpu1"])
    uniform = _3d(inputs, spec=spec, tp=2, pp=2, dp=1, devices=[*gtx[:2], "p100/gpu0", "p100/gpu1"])
    assert [g.tp_degree for g in mixed.groups] == [4, 2]
    sim, ref = simulate(*inputs[:2], mixed, inputs[2]), simulate(*inputs[:2], uniform, inputs[2])
    assert sim.feasible and len(sim.peak_memory_bytes) == 6
    held, ref_held = sim.persistent_memory_bytes, ref.persistent_memory_bytes
    assert held["p100/gpu1"] == ref_held["p100/gpu1"]
    assert held["gtx1/gpu1"] == held["gtx0/gpu0"] < ref_held["gtx0/gpu0"]
    tied = simulate(*small[:2], _3d(small, tp=[2, 1], pp=2, dp=1), small[2])  # embedding and head whole
    assert tied.feasible


def test_megatron_grid_enumerates_what_megatron_allows_and_ranks_by_the_simulator(small):
    """gpt2 with 12 heads and 4 blocks on 4 nodes × 2 GPUs: tp 1 or 2 (4 would leave a node,
    8 does not divide the heads), pp dividing 4 blocks, dp the rest of 8 devices."""
    graph, cluster, costs = small
    points = grid(graph, cluster, SMALL)
    assert {(tp, pp, dp) for tp, pp, dp, _ in points} == {
        (1, 1, 8),
        (1, 2, 4),
        (1, 4, 2),
        (2, 1, 4),
        (2, 2, 2),
        (2, 4, 1),
    }
    assert all(m == 1 for tp, pp, dp, m in points if pp == 1) and (2, 4, 1, 8) in points
    ranked = best_uniform(
        graph, cluster, costs, SMALL, deadline_s=time.perf_counter() + 60, precision="fp32", optimizer="sgd"
    )
    assert len(ranked) == len(points) and ranked[0].feasible
    assert ranked[0].iteration_time_s == min(p.iteration_time_s for p in ranked if p.feasible)
    best = ranked[0]
    again = _3d(small, tp=best.tp, pp=best.pp, dp=best.dp, microbatches=best.microbatches)
    assert simulate(graph, cluster, again, costs).iteration_time_s == best.iteration_time_s


def test_the_grid_starts_a_configuration_only_where_the_last_ones_time_is_left(small, monkeypatch):
    """best_uniform scores one configuration whatever its deadline, and another only where
    as long as the last one took is left (a split plan's scoring costs several simulations):
    on a clock that each scoring moves by one second."""
    graph, cluster, costs = small
    clock = [0.0]
    monkeypatch.setattr(three_d, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def one_second(plan):
        clock[0] += 1.0
        return simulate(graph, cluster, plan, costs, timeline=False)

    kw = {"precision": "fp32", "optimizer": "sgd", "score": one_second}
    for deadline, scored in ((0.5, 1), (1.5, 1), (3.0, 3)):
        clock[0] = 0.0
        assert len(best_uniform(graph, cluster, costs, SMALL, deadline_s=deadline, **kw)) == scored
        assert clock[0] <= max(deadline, 1.0)
