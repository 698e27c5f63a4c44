"""The planner never chooses a grouping the executor cannot cut (search/constraints.py).

The models here are loaded by the planner as 'tests/test_cut_constraints.py:NAME'. Every
candidate the planner reports is split by the executor's own partitioner (in-process, no
ranks), which refuses a batch statistic that crosses between placements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heterog.capture import capture_model
from heterog.cost import build_cost_model
from heterog.cut.partition import split_model
from heterog.errors import PlanError
from heterog.hardware.spec import cluster_from_dict
from heterog.ir.plan import ModelSpec
from heterog.search.constraints import ConstraintCache, violations
from heterog.search.grouping import make_groups
from heterog.search.planner import plan_graph

FILE = "tests/test_cut_constraints.py"
CLUSTER = cluster_from_dict(
    {
        "name": "four",
        "kind": "emulated",
        "nodes": [
            {
                "name": f"n{i}",
                "nic_bandwidth_gbps": 2,
                "devices": [{"type": "cpu", "name": f"n{i}/cpu{j}", "slowdown": 1 + i + j} for j in range(2)],
            }
            for i in range(2)
        ],
    }
)


class BatchScaled(nn.Module):
    """A statistic over the batch (no sample dimension, needs a gradient) read by a module."""

    class Mean(nn.Module):
        def forward(self, h):
            return h.mean(0, keepdim=True)

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.stat = self.Mean()
        self.scale = nn.Linear(64, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.relu(self.mid(h * self.scale(self.stat(h)))))


class Boxed(nn.Module):
    """Returns its logits in a plain Python object: the capture takes it (the loss unboxes
    it), torch.export does not (the output is no pytree), so the model cannot be split."""

    class Out:
        def __init__(self, logits):
            self.logits = logits

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x):
        return self.Out(self.fc3(torch.relu(self.fc2(torch.tanh(self.fc1(x))))))


class _Entry:
    default_seq_len = None

    def __init__(self, cls):
        self.cls = cls

    def build(self, **args):
        return self.cls()

    __call__ = build

    def example_batch(self, batch_size, seq_len=None, device="cpu", **args):
        return (torch.randn(batch_size, 16, device=device),), torch.randint(0, 4, (batch_size,), device=device)

    def loss(self, output, targets):
        return F.cross_entropy(getattr(output, "logits", output), targets)


batch_scaled = _Entry(BatchScaled)
boxed = _Entry(Boxed)


def _plan_all(name: str, cache: ConstraintCache, batch_size: int = 8):
    spec = ModelSpec(name=f"{FILE}:{name}", batch_size=batch_size)
    graph = capture_model(spec.name, batch_size=batch_size)
    costs = build_cost_model(graph, CLUSTER)
    result = plan_graph(
        graph, CLUSTER, costs, budget_s=2.0, max_iters=60, policy=False, model_spec=spec, cut_cache=cache
    )
    return graph, costs, result


def test_planned_groupings_never_put_a_batch_statistic_across_placements():
    cache = ConstraintCache()
    cuts = cache.get(ModelSpec(name=f"{FILE}:batch_scaled", batch_size=8))
    assert cuts.splittable and ("stat", "scale") in cuts.same_placement
    graph, costs, result = _plan_all("batch_scaled", cache)
    # without the constraints every node is a group of its own (fewer nodes than max_groups),
    # so the statistic's producer and consumer could be placed apart
    loose = make_groups(graph, CLUSTER, costs)
    assert [g for g in loose if "stat" in g] != [g for g in loose if "scale" in g]
    model = BatchScaled()
    example = (torch.randn(4, 16),)
    assert {c.strategy for c in result.candidates} >= {"model-parallel", "pipeline", "search"}
    for c in result.candidates:
        group_of = {n: gi for gi, g in enumerate(c.plan.groups) for n in g.nodes}
        assert violations(cuts, group_of, [g.replicas for g in c.plan.groups]) == [], c.strategy
        split_model(model, c.plan, example)  # the executor's partitioner accepts it (raises if not)


def test_the_executor_refuses_what_the_constraints_forbid():
    """The constraint is real: the same model cut between 'stat' and 'scale' on two placements."""
    cache = ConstraintCache()
    graph, _, result = _plan_all("batch_scaled", cache)
    from dataclasses import replace

    plan = result.plan_of("model-parallel")
    names = [n.name for n in graph.nodes]
    cut = names.index("scale")
    first, second = plan.groups[0], plan.groups[-1]
    apart = replace(
        plan,
        groups=(
            replace(first, name="a", nodes=tuple(names[:cut])),
            replace(second, name="b", nodes=tuple(names[cut:])),
        ),
    )
    assert apart.groups[0].replicas != apart.groups[1].replicas
    try:
        split_model(BatchScaled(), apart, (torch.randn(4, 16),))
    except PlanError as e:
        assert "no sample dimension" in str(e)
    else:
        raise AssertionError("a batch statistic crossed between placements")


def test_an_unsplittable_model_gets_only_unsplit_plans_and_the_export_is_cached():
    cache = ConstraintCache()
    spec = ModelSpec(name=f"{FILE}:boxed", batch_size=8)
    cuts = cache.get(spec)
    assert not cuts.splittable and cuts.reason
    assert cache.get(spec) is cuts and len(cache) == 1  # exported once
    _, _, result = _plan_all("boxed", cache)
    assert len(cache) == 1
    for c in result.candidates:
        split = any(g.replicas != c.plan.groups[0].replicas for g in c.plan.groups)
        assert not (split and c.feasible), f"{c.strategy}: a split plan of an unexportable model is feasible"
    mp = next(c for c in result.candidates if c.strategy == "model-parallel")
    assert not mp.feasible
    assert all(g.replicas == result.best.groups[0].replicas for g in result.best.groups)


def test_nodes_without_data_join_their_consumers_group():
    """GPT-2's position embedding reads only position ids built from sizes: the executor runs
    it with its consumer, so the grouping puts it there."""
    args = dict(hidden=16, layers=1, heads=2, vocab=64, positions=16, dropout=0.0)
    cache = ConstraintCache()
    spec = ModelSpec(name="gpt2", args=args, batch_size=4, seq_len=8)
    cuts = cache.get(spec)
    assert "transformer.wpe" in cuts.follow_consumers
    graph = capture_model("gpt2", args, batch_size=4, seq_len=8)
    costs = build_cost_model(graph, CLUSTER)
    consumers = {e.dst for e in graph.edges if e.src == "transformer.wpe"}
    assert consumers
    for max_groups in (4, 8, 64):
        groups = make_groups(graph, CLUSTER, costs, max_groups, cuts)
        owner = {n: gi for gi, g in enumerate(groups) for n in g}
        assert sorted(owner) == sorted(n.name for n in graph.nodes)
        assert owner["transformer.wpe"] == min(owner[c] for c in consumers), max_groups
    # each node alone in a group: without the constraints wpe would sit apart
    alone = make_groups(graph, CLUSTER, costs, 1000)
    assert ("transformer.wpe",) in alone
