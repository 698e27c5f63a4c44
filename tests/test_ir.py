"""The shared artifacts: OpGraph and Plan validate, round-trip through JSON, and fail clearly."""

import json

import pytest

from heterog.errors import ArtifactError, GraphError, PlanError
from heterog.ir import Affine, Group, ModelSpec, OpEdge, OpGraph, OpNode, Plan, Replica, split_samples


def _graph() -> OpGraph:
    nodes = (
        OpNode(
            name="fc1",
            module_path="fc1",
            module_type="Linear",
            kind="matmul",
            fwd_flops=Affine(0, 2e6),
            bwd_flops=Affine(0, 4e6),
            param_names=("fc1.weight",),
            param_count=1000,
            param_bytes=4000,
            saved_bytes=Affine(0, 40),
        ),
        OpNode(name="root::relu@0", module_path="", module_type="Net", kind="elementwise"),
        OpNode(name="fc2", module_path="fc2", module_type="Linear", kind="matmul", param_count=10, param_bytes=40),
    )
    edges = (
        OpEdge(src="fc1", dst="root::relu@0", bytes=Affine(0, 400)),
        OpEdge(src="root::relu@0", dst="fc2", bytes=Affine(0, 400)),
    )
    return OpGraph(model="net", batch_size=4, nodes=nodes, edges=edges, num_parameters=1010).validate()


def test_opgraph_round_trips_through_json(tmp_path):
    g = _graph()
    path = tmp_path / "g.json"
    g.save(path)
    again = OpGraph.load(path)
    assert again.nodes == g.nodes and again.edges == g.edges
    assert again.fingerprint() == g.fingerprint()
    assert again.forward_flops(8) == pytest.approx(16e6)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["edges"].append(["fc2", "fc1", [0, 1]]), "cycle"),
        (lambda d: d["edges"].append(["fc2", "nowhere", [0, 1]]), "dangling"),
        (lambda d: d["nodes"][0].update(saved_bytes=[-5, 0]), "negative"),
        (lambda d: d["nodes"][1].update(kind="teleport"), "unknown kind"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate"),
        (lambda d: d["nodes"][0].pop("kind"), "missing field 'kind'"),
    ],
)
def test_malformed_graph_file_names_the_problem(tmp_path, mutate, message):
    doc = json.loads(_graph().to_json())
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(GraphError, match=message):
        OpGraph.load(path)


def test_wrong_artifact_kind_and_bad_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        OpGraph.load(p)
    p.write_text(json.dumps({"kind": "heterog.Plan", "version": 1}))
    with pytest.raises(ArtifactError, match="'heterog.Plan' artifact"):
        OpGraph.load(p)


def _plan(**over) -> Plan:
    groups = (
        Group(
            name="g0",
            nodes=("fc1", "root::relu@0"),
            sync="ring",
            replicas=(Replica(device="a", share=0.75), Replica(device="b", share=0.25)),
        ),
        Group(name="g1", nodes=("fc2",), replicas=(Replica(device="a", share=1.0),)),
    )
    kw = dict(strategy="test", model=ModelSpec(name="net", batch_size=8), groups=groups)
    kw.update(over)
    return Plan(**kw)


def test_plan_round_trips_and_validates_against_graph(tmp_path):
    plan = _plan().validate(graph=_graph())
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert plan.replica_samples(plan.groups[0], 0) == [6, 2]


@pytest.mark.parametrize(
    "over, message",
    [
        (
            dict(groups=(Group(name="g0", nodes=("fc1",), replicas=(Replica(device="a", share=0.6),)),)),
            "group 'g0': replica shares sum to 0.6",
        ),
        (dict(num_microbatches=0), "num_microbatches"),
        (
            dict(
                groups=(
                    Group(
                        name="g0",
                        nodes=("fc1", "root::relu@0", "fc2"),
                        sync="ps",
                        replicas=(Replica(device="a", share=1.0),),
                    ),
                )
            ),
            "ps_device is not set",
        ),
    ],
)
def test_bad_plans_name_the_group_and_field(over, message):
    with pytest.raises(PlanError, match=message):
        _plan(**over).validate()


def test_plan_missing_node_and_replicated_without_sync():
    g = _graph()
    partial = _plan(groups=_plan().groups[:1])
    with pytest.raises(PlanError, match="belong to no group"):
        partial.validate(graph=g)
    groups = (
        Group(
            name="g0",
            nodes=tuple(n.name for n in g.nodes),
            sync="none",
            replicas=(Replica(device="a", share=0.5), Replica(device="b", share=0.5)),
        ),
    )
    with pytest.raises(PlanError, match="sync is 'none'"):
        _plan(groups=groups).validate(graph=g)


@pytest.mark.parametrize("total, shares", [(10, [1, 1, 1]), (7, [0.8, 0.2]), (1, [0.5, 0.5]), (100, [4, 1])])
def test_split_samples_sums_and_tracks_shares(total, shares):
    counts = split_samples(total, shares)
    assert sum(counts) == total
    for c, s in zip(counts, shares):
        assert abs(c - total * s / sum(shares)) < 1
