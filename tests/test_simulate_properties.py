"""Properties over random plans, bad plans, priorities and the trace export."""

import dataclasses
import json
import random

import pytest

from heterog.errors import PlanError
from heterog.ir.plan import Group, Replica
from heterog.lower.context import SimCache
from heterog.simulate import assign_priorities, node_ranks, simulate
from tests.simulate_support import TableCosts, chain_graph, cluster, graph, node, plan, with_link_bandwidth

GF, RATE = 1e9, 1e12


def _random_plan(rng: random.Random, devices, n_layers: int, batch: int):
    cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, min(4, n_layers - 1))))
    bounds = [0, *cuts, n_layers]
    groups = []
    for k in range(len(bounds) - 1):
        devs = rng.sample(devices, rng.randint(1, len(devices)))
        weights = [rng.uniform(0.2, 1.0) for _ in devs]
        total = sum(weights)
        shares = [w / total for w in weights]
        shares[-1] = 1.0 - sum(shares[:-1])
        groups.append((f"g{k}", [f"l{i}" for i in range(bounds[k], bounds[k + 1])], list(zip(devs, shares))))
    sync = rng.choice(["ring", "tree", "hierarchical"])
    p = plan(
        groups,
        batch_size=batch,
        sync=sync,
        num_microbatches=rng.choice([1, 2, 4]),
        schedule=rng.choice(["gpipe", "1f1b"]),
        bucket_bytes=rng.choice([4_000_000, 2**30]),
    )
    if rng.random() < 0.3:  # some groups use a parameter server
        gs = tuple(
            dataclasses.replace(gr, sync="ps", ps_device=rng.choice(devices)) if len(gr.replicas) > 1 else gr
            for gr in p.groups
        )
        p = dataclasses.replace(p, groups=gs)
    return p


def test_raising_a_link_bandwidth_never_lengthens_the_iteration():
    rng = random.Random(7)
    n_layers, batch = 8, 16
    g = chain_graph(n_layers, flops=GF, edge_bytes=2e5, param_bytes=2_000_000)
    clusters = [
        cluster([[RATE, 2 * RATE], [RATE], [0.5 * RATE, RATE]], nic_bandwidth=1e9, latency_s=1e-6),
        cluster(
            [[RATE, 2 * RATE], [RATE], [0.5 * RATE, RATE]], nic_bandwidth=1e9, latency_s=1e-6, core_bandwidth=1.5e9
        ),
    ]
    devices = [d.name for d in clusters[0].devices]
    checked = 0
    for trial in range(80):
        base = clusters[trial % 2]
        p = _random_plan(rng, devices, n_layers, batch)
        before = simulate(g, base, p, TableCosts(g, base)).iteration_time_s
        # a transfer is limited by the slowest link on its path, so raise a random set of links
        faster = base
        for link in rng.sample(sorted(base.links), rng.randint(1, len(base.links))):
            faster = with_link_bandwidth(faster, link, base.links[link].bandwidth_bytes_per_s * rng.uniform(1.5, 20))
        after = simulate(g, faster, p, TableCosts(g, faster)).iteration_time_s
        assert after <= before * (1 + 1e-9), p.to_dict()
        checked += after < before * (1 - 1e-6)
    assert checked > 5  # the property is not vacuous: faster links often help


def test_random_plans_are_consistent():
    rng = random.Random(3)
    g = chain_graph(6, flops=GF, edge_bytes=1e5)
    c = cluster([[RATE, RATE], [2 * RATE]], nic_bandwidth=1e9)
    costs = TableCosts(g, c)
    devices = [d.name for d in c.devices]
    for _ in range(30):
        p = _random_plan(rng, devices, 6, 12)
        r = simulate(g, c, p, costs)
        # a lower bound: the busiest device's compute
        assert r.iteration_time_s >= max(r.compute_time_s.values()) - 1e-12
        for *_, s, e, _op in r.events:
            assert 0 <= s <= e <= r.iteration_time_s + 1e-12
        # no two compute tasks overlap on a device; no two transfers overlap on a link
        by_track: dict[str, list] = {}
        for _, cat, track, s, e, _op in r.events:
            if cat in ("forward", "backward", "optimizer") or track.startswith("link:"):
                by_track.setdefault(track, []).append((s, e))
        for spans in by_track.values():
            spans.sort()
            for (_, e0), (s1, _) in zip(spans, spans[1:]):
                assert s1 >= e0 - 1e-12
        assert r.throughput_samples_per_s == pytest.approx(12 / r.iteration_time_s)


def _two_group_plan(**over):
    groups = (
        Group(
            name="head",
            nodes=("l0", "l1"),
            sync="ring",
            replicas=(Replica(device="n0/d0", share=0.5), Replica(device="n1/d1", share=0.5)),
        ),
        Group(name="tail", nodes=("l2", "l3"), replicas=(Replica(device="n0/d0", share=1.0),)),
    )
    p = plan([("x", ["l0"], [("n0/d0", 1.0)])])
    return dataclasses.replace(p, groups=over.pop("groups", groups), **over)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda gs: (
                dataclasses.replace(
                    gs[0], replicas=(Replica(device="n0/d0", share=0.5), Replica(device="n1/d1", share=0.4))
                ),
                gs[1],
            ),
            ["group 'head'", "shares sum to 0.9"],
        ),
        (
            lambda gs: (gs[0], dataclasses.replace(gs[1], replicas=(Replica(device="n9/d9", share=1.0),))),
            ["group 'tail'", "'replicas'", "'n9/d9'"],
        ),
        (lambda gs: (gs[0],), ["belong to no group", "'l2'"]),
        (lambda gs: (gs[0], dataclasses.replace(gs[1], nodes=("l1", "l2", "l3"))), ["group 'tail'", "'nodes'", "'l1'"]),
        (lambda gs: (dataclasses.replace(gs[0], sync="ps"), gs[1]), ["group 'head'", "ps_device"]),
        (
            lambda gs: (dataclasses.replace(gs[0], sync="ps", ps_device="zz"), gs[1]),
            ["group 'head'", "'ps_device'", "'zz'"],
        ),
        (lambda gs: (dataclasses.replace(gs[0], sync="none"), gs[1]), ["group 'head'", "'sync'"]),
    ],
)
def test_bad_plans_name_the_group_and_field(mutate, words):
    g = chain_graph(4)
    c = cluster([[RATE], [RATE]])
    good = _two_group_plan()
    simulate(g, c, good, TableCosts(g, c))
    bad = dataclasses.replace(good, groups=mutate(good.groups))
    with pytest.raises(PlanError) as err:
        simulate(g, c, bad, TableCosts(g, c))
    for w in words:
        assert w in str(err.value)


def test_groups_that_depend_on_each_other_are_rejected():
    g = chain_graph(3)
    c = cluster([[RATE], [RATE]])
    p = plan([("a", ["l0", "l2"], [("n0/d0", 1.0)]), ("b", ["l1"], [("n1/d1", 1.0)])])
    with pytest.raises(PlanError, match="groups 'a' and 'b' depend on each other"):
        simulate(g, c, p, TableCosts(g, c))


def _fork():
    # 'root' feeds a long branch (a1 → a2 → a3, whose end runs on another device) and a
    # short one (b); both branches start on device 0 and compete for it
    nodes = [
        node("root", GF),
        node("a1", GF),
        node("a2", 4 * GF),
        node("a3", 4 * GF),
        node("b", 2 * GF),
        node("join", GF),
    ]
    edges = [
        ("root", "a1", 0.0),
        ("a1", "a2", 0.0),
        ("a2", "a3", 0.0),
        ("root", "b", 0.0),
        ("a3", "join", 0.0),
        ("b", "join", 0.0),
    ]
    g = graph(nodes, edges, batch_size=4)
    c = cluster([[RATE], [RATE]])
    p = plan(
        [
            ("r", ["root"], [("n0/d0", 1.0)]),
            ("b", ["b"], [("n0/d0", 1.0)]),
            ("a1", ["a1"], [("n0/d0", 1.0)]),
            ("a23", ["a2", "a3"], [("n1/d1", 1.0)]),
            ("j", ["join"], [("n0/d0", 1.0)]),
        ],
        batch_size=4,
    )
    return g, c, p


def test_upward_rank_runs_the_critical_branch_first():
    g, c, p = _fork()
    costs = TableCosts(g, c)
    ranks = node_ranks(g, c, p, costs, "upward")
    for e in g.edges:  # an upward rank decreases along every edge
        assert ranks[e.src] > ranks[e.dst]
    up = assign_priorities(g, c, p, costs, "upward")
    assert set(up.priorities) == {n.name for n in g.nodes}
    assert up.priorities["a1"] > up.priorities["b"]
    worst = dataclasses.replace(p, priorities={"b": 10.0})  # the short branch first
    t_up = simulate(g, c, up, costs).iteration_time_s
    t_bad = simulate(g, c, worst, costs).iteration_time_s
    assert t_up < t_bad
    hg = assign_priorities(g, c, p, costs, "heteroG")
    # HeteroG: rank = longest path from the sources; earliest-startable ops first
    assert hg.priorities["root"] == 0.0
    assert hg.priorities["a1"] == hg.priorities["b"] < 0
    assert simulate(g, c, hg, costs).iteration_time_s >= t_up - 1e-12
    with pytest.raises(PlanError, match="priority method"):
        assign_priorities(g, c, p, costs, "random")


def test_chrome_trace_has_a_process_per_device_and_link_tracks(tmp_path):
    g = chain_graph(4, edge_bytes=1e5)
    c = cluster([[RATE, RATE], [RATE]])
    p = plan(
        [("a", ["l0", "l1"], [("n0/d0", 0.5), ("n0/d1", 0.5)]), ("b", ["l2", "l3"], [("n1/d2", 1.0)])],
        num_microbatches=2,
    )
    r = simulate(g, c, p, TableCosts(g, c))
    trace = r.to_chrome_trace()
    text = json.dumps(trace)
    back = json.loads(text)["traceEvents"]
    names = {e["args"]["name"] for e in back if e.get("name") == "process_name"}
    assert names == {"n0/d0", "n0/d1", "n1/d2", "links"}
    spans = [e for e in back if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"forward", "backward", "transfer", "sync", "optimizer"}
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(r.iteration_time_s * 1e6)
    assert any(e["ph"] == "C" for e in back)
    d = r.to_dict()
    assert json.loads(json.dumps(d))["devices"]["n1/d2"]["compute_time_s"] > 0
    assert len(json.loads(r.to_json())["events"]) == len(r.events)


def test_shortcuts_give_the_same_answer():
    """Symmetric devices simulated once and copied micro-batches change nothing."""
    from heterog.lower.schedule import build_schedule
    from heterog.simulate.simulator import time_schedule

    rng = random.Random(5)
    g = chain_graph(6, flops=GF, edge_bytes=1e5, param_bytes=3_000_000)
    c = cluster([[RATE, RATE, 2 * RATE, 2 * RATE], [RATE, RATE, 2 * RATE, 2 * RATE]], nic_bandwidth=1e9)
    devices = [d.name for d in c.devices]
    merged_some = False
    for trial in range(12):
        shares = [1.0 if "d2" in d or "d3" in d or "d6" in d or "d7" in d else 0.5 for d in devices]
        total = sum(shares)
        reps = [(d, s / total) for d, s in zip(devices, shares)]
        cut = rng.randint(1, 5)
        groups = [("a", [f"l{i}" for i in range(cut)], reps), ("b", [f"l{i}" for i in range(cut, 6)], reps)]
        if trial % 3 == 2:  # a pipeline stage in front breaks the symmetry of some devices
            groups[0] = ("a", [f"l{i}" for i in range(cut)], [("n0/d0", 1.0)])
        p = plan(
            groups,
            batch_size=rng.choice([24, 48, 50]),
            num_microbatches=rng.choice([1, 2, 3, 4]),
            schedule=rng.choice(["gpipe", "1f1b"]),
            bucket_bytes=rng.choice([3_000_000, 2**30]),
            sync=rng.choice(["ring", "ps"]),
        )
        if p.groups[-1].sync == "ps":
            p = dataclasses.replace(
                p, groups=tuple(dataclasses.replace(x, ps_device="n1/d4") if x.sync == "ps" else x for x in p.groups)
            )
        costs = TableCosts(g, c)
        fast = simulate(g, c, p, costs)
        slow = time_schedule(build_schedule(g, c, p, costs, merge=False))
        merged_some |= fast.num_tasks < slow.num_tasks
        assert fast.iteration_time_s == pytest.approx(slow.iteration_time_s, rel=1e-12)
        assert fast.peak_memory_bytes == slow.peak_memory_bytes
        assert fast.compute_time_s == pytest.approx(slow.compute_time_s)
        assert fast.communication_time_s == pytest.approx(slow.communication_time_s)
        assert fast.link_bytes == pytest.approx(slow.link_bytes)

        def spans(r):
            return sorted((e[0], e[2], round(e[3], 12), round(e[4], 12)) for e in r.events)

        assert spans(fast) == spans(slow)
        assert len(fast.events) == len(slow.events)
    assert merged_some


def test_reference_order_reports_a_deadlocked_admission_rule():
    # one device, limit 1 micro-batch in flight, but micro-batch 0's backward waits for
    # micro-batch 1's forward: the 1F1B rule can never admit it, list scheduling without it can
    from heterog.lower.order import reference_order
    from heterog.lower.taskgraph import BWD, FWD, Tasks

    t = Tasks([], 1, 2)
    f0 = t.add(FWD, 1.0, 0, t.prio(1, 0, 0), 0)
    f1 = t.add(FWD, 1.0, 0, t.prio(1, 1, 0), 1)
    b0 = t.add(BWD, 2.0, 0, t.prio(0, 0, 0), 0)
    b1 = t.add(BWD, 2.0, 0, t.prio(0, 1, 0), 1)
    for a, b in ((f0, b0), (f1, b0), (f1, b1)):
        t.dep(a, b)
    t.bwd_count = {(0, 0): 1, (0, 1): 1}
    t.stage_limit = [1]
    t.seal()
    assert reference_order(t, 1, "1f1b") is None
    assert reference_order(t, 1, "1f1b", limit_in_flight=False).tolist() == [f0, f1, b0, b1]
    assert reference_order(t, 1, "gpipe").tolist() == [f0, f1, b0, b1]


def test_warm_caches_across_calls_give_the_same_answer_as_a_fresh_cost_model():
    """The simulator caches block columns and costs across calls (as the search re-scores
    neighbours); a sequence of plans scored warm must equal each plan scored from scratch."""
    rng = random.Random(11)
    g = chain_graph(8, flops=GF, edge_bytes=2e5)
    c = cluster([[RATE, RATE], [2 * RATE, 3 * RATE]], nic_bandwidth=1e9)
    warm, cache = TableCosts(g, c), SimCache()
    devices = [d.name for d in c.devices]
    plans = [_random_plan(rng, devices, 8, 16) for _ in range(25)]
    for p in plans + plans[::-1]:
        a = simulate(g, c, p, warm, cache=cache)
        b = simulate(g, c, p, TableCosts(g, c))
        assert a.iteration_time_s == b.iteration_time_s
        assert a.peak_memory_bytes == b.peak_memory_bytes
        assert a.events == b.events


def test_the_array_form_of_the_repartition_rule_is_the_rule():
    """lower/blocks.py keeps the re-partition rule twice — a generator for a few replicas and
    arrays for hundreds: random splits of one batch, empty replicas included, give the same
    overlaps in the same order."""
    from heterog.lower.blocks import overlap_arrays, overlaps

    rng = random.Random(3)
    for _ in range(3000):
        a = [rng.choice((0, 0, 1, 2, 3, 5, 8, 13)) for _ in range(rng.randint(0, 7))]
        total = sum(a)
        cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 6)))
        b = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, total])] if a or cuts else []
        i, j, n = overlap_arrays(a, b)
        assert list(overlaps(a, b)) == list(zip(i.tolist(), j.tolist(), n.tolist())), (a, b)
