"""The simulator against answers written by hand (TableCosts gives closed-form times)."""

import pytest

from heterog.ir.kinds import Phase
from heterog.simulate import simulate
from tests.simulate_support import TableCosts, chain_graph, cluster, graph, node, plan

GF = 1e9  # FLOPs per sample per layer (forward); backward is 2×
RATE = 1e12  # FLOP/s of the test devices


def test_one_device_is_sum_of_op_times_plus_optimizer_step():
    g = chain_graph(5, flops=GF, param_bytes=4_000_000)
    c = cluster([[RATE]])
    costs = TableCosts(g, c)
    for mbs in (1, 4):
        p = plan([("all", [f"l{i}" for i in range(5)], [("n0/d0", 1.0)])], batch_size=8, num_microbatches=mbs)
        r = simulate(g, c, p, costs)
        ops = sum(costs.compute_time_s(n.name, "n0/d0", 8, ph) for n in g.nodes for ph in Phase)
        step = costs.optimizer_time_s([n.name for n in g.nodes], "n0/d0")
        assert ops == pytest.approx(5 * 3 * GF * 8 / RATE)
        assert r.iteration_time_s == pytest.approx(ops + step)
        assert r.throughput_samples_per_s == pytest.approx(8 / (ops + step))
        assert r.idle_time_s["n0/d0"] == pytest.approx(0.0, abs=1e-12)


def test_one_device_split_in_groups_changes_nothing():
    g = chain_graph(6)
    c = cluster([[RATE]])
    costs = TableCosts(g, c)
    one = plan([("all", [f"l{i}" for i in range(6)], [("n0/d0", 1.0)])])
    three = plan([(f"g{k}", [f"l{2 * k}", f"l{2 * k + 1}"], [("n0/d0", 1.0)]) for k in range(3)])
    assert simulate(g, c, three, costs).iteration_time_s == pytest.approx(simulate(g, c, one, costs).iteration_time_s)


def test_even_data_parallelism_is_compute_plus_allreduce_plus_step():
    n_layers, batch, params = 4, 16, 8_000_000
    g = chain_graph(n_layers, flops=GF, param_bytes=params)
    c = cluster([[RATE, RATE], [RATE, RATE]], nic_bandwidth=2e9, intra_bandwidth=20e9)
    costs = TableCosts(g, c)
    devs = ["n0/d0", "n0/d1", "n1/d2", "n1/d3"]
    nodes = [f"l{i}" for i in range(n_layers)]
    # one bucket: the all-reduce cannot overlap the backward
    p = plan([("all", nodes, [(d, 0.25) for d in devs])], batch_size=batch, bucket_bytes=2**40)
    r = simulate(g, c, p, costs)
    compute = n_layers * 3 * GF * (batch / 4) / RATE
    allreduce = 2 * 3 / 4 * (n_layers * params) / 2e9  # ring, limited by the 2 GB/s NICs
    step = 1e-9 * n_layers * params
    assert r.iteration_time_s == pytest.approx(compute + allreduce + step)
    assert r.compute_time_s["n0/d0"] == pytest.approx(compute + step)
    assert r.communication_time_s["n1/d3"] == pytest.approx(allreduce)
    # the ring crosses each NIC once per direction, 2(n−1)/n of the buffer each way
    assert r.link_bytes["n0.nic.up"] == pytest.approx(1.5 * n_layers * params)
    # buckets of one layer: sync of later layers overlaps the backward of earlier ones
    groups = [(f"g{i}", [f"l{i}"], [(d, 0.25) for d in devs]) for i in range(n_layers)]
    bucketed = simulate(g, c, plan(groups, batch_size=batch, bucket_bytes=params), costs)
    one_layer_sync = allreduce / n_layers
    assert bucketed.iteration_time_s < r.iteration_time_s
    assert bucketed.iteration_time_s >= compute + one_layer_sync + step - 1e-12
    # the syncs serialise on the NICs: they end no earlier than the last backward + all of them
    first_bwd_end = compute - n_layers * 2 * GF * (batch / 4) / RATE + 2 * GF * (batch / 4) / RATE
    assert bucketed.iteration_time_s >= first_bwd_end + allreduce + step - 1e-12


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_matches_gpipe_formula(m, schedule):
    # edges carry no bytes, so stages hand over instantly: (m + p − 1)(t_f + t_b) + step
    g = chain_graph(4, flops=GF, edge_bytes=0.0)
    c = cluster([[RATE], [RATE]])
    costs = TableCosts(g, c)
    batch = 16
    p = plan(
        [("s0", ["l0", "l1"], [("n0/d0", 1.0)]), ("s1", ["l2", "l3"], [("n1/d1", 1.0)])],
        batch_size=batch,
        num_microbatches=m,
        schedule=schedule,
    )
    r = simulate(g, c, p, costs)
    t_f = 2 * GF * (batch / m) / RATE
    t_b = 2 * t_f
    step = 1e-9 * 2 * 4_000_000
    assert r.iteration_time_s == pytest.approx((m + 2 - 1) * (t_f + t_b) + step)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_backward_after_the_first_adds_into_the_held_gradients(schedule):
    # one device, m micro-batches: m (t_f + t_b) + (m − 1) accumulations + step; micro-batch
    # 0's backwards create the gradients, every later one adds into them
    g = chain_graph(4, flops=GF, edge_bytes=0.0)
    c = cluster([[RATE]])
    acc_per_byte = 2e-9
    costs = TableCosts(g, c, accumulate_s_per_byte=acc_per_byte)
    batch, m = 16, 4
    p = plan(
        [("s0", ["l0", "l1"], [("n0/d0", 1.0)]), ("s1", ["l2", "l3"], [("n0/d0", 1.0)])],
        batch_size=batch,
        num_microbatches=m,
        schedule=schedule,
    )
    r = simulate(g, c, p, costs)
    t_f = 4 * GF * (batch / m) / RATE
    params = 4 * 4_000_000
    step = 1e-9 * params
    assert r.iteration_time_s == pytest.approx(m * 3 * t_f + (m - 1) * acc_per_byte * params + step)
    # the search's estimate keeps the same rule
    from heterog.search.estimate import estimate
    from heterog.search.grouping import make_groups
    from heterog.search.problem import Placement, Problem, Strategy

    prob = Problem(graph=g, cluster=c, costs=costs, groups=make_groups(g, c, costs, 2), batch_size=batch)
    one = Placement(devices=(0,), shares=(1.0,))
    est = estimate(prob, Strategy(placements=(one,) * prob.n_groups, microbatches=m, schedule=schedule))
    assert est.iteration_time_s == pytest.approx(r.iteration_time_s, rel=1e-6)


def test_one_f_one_b_keeps_fewer_activations_than_gpipe():
    g = chain_graph(4, flops=GF, edge_bytes=0.0, saved=1e6)
    c = cluster([[RATE], [RATE]])
    costs = TableCosts(g, c)
    kw = dict(batch_size=16, num_microbatches=8)
    groups = [("s0", ["l0", "l1"], [("n0/d0", 1.0)]), ("s1", ["l2", "l3"], [("n1/d1", 1.0)])]
    gp = simulate(g, c, plan(groups, schedule="gpipe", **kw), costs)
    fb = simulate(g, c, plan(groups, schedule="1f1b", **kw), costs)
    act_per_mb = 2 * 1e6 * 2  # two layers × 1 MB per sample × 2 samples
    pers = 2 * 2 * 4_000_000
    assert gp.peak_memory_bytes["n0/d0"] == pers + 8 * act_per_mb  # all 8 in flight
    assert fb.peak_memory_bytes["n0/d0"] == pers + 2 * act_per_mb  # first of 2 stages: 2
    assert fb.peak_memory_bytes["n1/d1"] == pers + 1 * act_per_mb  # last stage: 1


def test_transfers_between_stages_are_on_the_critical_path():
    g = chain_graph(2, flops=GF, edge_bytes=1e6)
    c = cluster([[RATE], [RATE]], nic_bandwidth=1e9, latency_s=1e-5)
    costs = TableCosts(g, c)
    p = plan([("s0", ["l0"], [("n0/d0", 1.0)]), ("s1", ["l1"], [("n1/d1", 1.0)])], batch_size=4)
    r = simulate(g, c, p, costs)
    xfer = costs.transfer_time_s(4e6, "n0/d0", "n1/d1")
    assert xfer == pytest.approx(4 * 1e-5 / 2 + 4e6 / 1e9)  # 4 links of half latency + bytes/bw
    compute = 3 * GF * 4 / RATE * 2
    assert r.iteration_time_s == pytest.approx(compute + 2 * xfer + 1e-9 * 4_000_000)
    assert r.link_bytes["n0.nic.up"] == pytest.approx(4e6)  # activations forward
    assert r.link_bytes["n1.nic.up"] == pytest.approx(4e6)  # their gradients back


def test_uneven_shares_repartition_only_the_samples_that_move():
    # g0 on d0 (all 8 samples) → g1 on d0 (6) and d1 (2): only 2 samples travel
    g = chain_graph(2, flops=GF, edge_bytes=1e6, param_bytes=0)
    c = cluster([[RATE], [RATE]], nic_bandwidth=1e9)
    costs = TableCosts(g, c)
    p = plan(
        [("g0", ["l0"], [("n0/d0", 1.0)]), ("g1", ["l1"], [("n0/d0", 0.75), ("n1/d1", 0.25)])],
        batch_size=8,
        sync="ring",
    )
    r = simulate(g, c, p, costs)
    assert r.link_bytes["n0.nic.up"] == pytest.approx(2e6)
    assert r.link_bytes["n1.nic.up"] == pytest.approx(2e6)


def test_two_transfers_sharing_a_nic_take_twice_as_long_as_one():
    # 'src' on node 0 feeds two consumers on node 1: both transfers cross n0.nic.up
    nodes = [node("src", GF), node("a", GF), node("b", GF)]

    def xfer_ends(consumers, devices):
        g = graph(nodes[: 1 + len(consumers)], [("src", x, 1e6) for x in consumers], batch_size=4)
        c = cluster([[RATE], [RATE, RATE], [RATE]], nic_bandwidth=1e9)
        groups = [("g_src", ["src"], [("n0/d0", 1.0)])]
        groups += [(f"g_{x}", [x], [(d, 1.0)]) for x, d in zip(consumers, devices)]
        r = simulate(g, c, plan(groups, batch_size=4), TableCosts(g, c))
        fwd = [
            (s, e)
            for name, cat, track, s, e, _op in r.events
            if cat == "transfer" and track == "link:n0.nic.up" and "→" in name and "n0/d0→" in name
        ]
        return sorted(fwd)

    one = xfer_ends(["a"], ["n1/d1"])
    two = xfer_ends(["a", "b"], ["n1/d1", "n1/d2"])
    t = 4e6 / 1e9
    assert len(one) == 1 and one[0][1] - one[0][0] == pytest.approx(t)
    assert len(two) == 2
    start = two[0][0]
    assert max(e for _, e in two) - start == pytest.approx(2 * t)  # twice as long for both
    # disjoint paths (different NICs at both ends): no contention, both take t
    g = graph(
        [node("s1", GF), node("s2", GF), node("a", GF), node("b", GF)],
        [("s1", "a", 1e6), ("s2", "b", 1e6)],
        batch_size=4,
    )
    c = cluster([[RATE], [RATE], [RATE], [RATE]], nic_bandwidth=1e9)
    groups = [
        ("g1", ["s1"], [("n0/d0", 1.0)]),
        ("g2", ["s2"], [("n1/d1", 1.0)]),
        ("ga", ["a"], [("n2/d2", 1.0)]),
        ("gb", ["b"], [("n3/d3", 1.0)]),
    ]
    r = simulate(g, c, plan(groups, batch_size=4), TableCosts(g, c))
    fwd = [
        (s, e)
        for name, cat, track, s, e, _op in r.events
        if cat == "transfer"
        and track.startswith("link:")
        and track.endswith(".nic.up")
        and name.endswith(("n2/d2", "n3/d3"))
    ]
    assert len(fwd) == 2 and all(e - s == pytest.approx(t) for s, e in fwd)
    assert fwd[0][0] == pytest.approx(fwd[1][0])


def test_memory_peak_matches_hand_computation_and_overflow_is_named():
    n0 = node("x", GF, param_bytes=1000, saved_per_sample=100.0, workspace_per_sample=10.0)
    n1 = node("y", GF, param_bytes=3000, saved_per_sample=50.0, workspace_per_sample=40.0)
    g = graph([n0, n1], [("x", "y", 0.0)], batch_size=4)
    groups = [("gx", ["x"], [("n0/d0", 1.0)]), ("gy", ["y"], [("n0/d0", 1.0)])]
    c = cluster([[RATE]])
    r = simulate(g, c, plan(groups, batch_size=4), TableCosts(g, c))
    persistent = 2 * (1000 + 3000)  # weights + gradients (TableCosts, SGD)
    weights = 1000 + 3000
    # gradients appear during the backward (zero_grad(set_to_none=True)):
    #   end of forward:   weights + x, y activations + y's workspace   = 4000 + 400 + 200 + 160 = 4760
    #   backward of y:    weights + x, y activations + y's workspace + y's gradients = 7760
    #   backward of x:    weights + x's activations + x's workspace + all gradients  = 8440
    assert r.persistent_memory_bytes["n0/d0"] == persistent
    assert r.peak_memory_bytes["n0/d0"] == weights + 4 * 100 + 4 * 10 + 4000
    assert r.feasible and r.overflow_device is None
    small = cluster([[RATE]], memory_bytes=8000)
    r2 = simulate(g, small, plan(groups, batch_size=4), TableCosts(g, small))
    assert not r2.feasible
    assert r2.overflow_device == "n0/d0"
    assert r2.overflow_bytes == 8440 - 8000
    # the same plan with y's gradients the large ones peaks at y's backward instead
    n0b = node("x", GF, param_bytes=3000, saved_per_sample=100.0, workspace_per_sample=10.0)
    n1b = node("y", GF, param_bytes=1000, saved_per_sample=50.0, workspace_per_sample=40.0)
    g2 = graph([n0b, n1b], [("x", "y", 0.0)], batch_size=4)
    r3 = simulate(g2, c, plan(groups, batch_size=4), TableCosts(g2, c))
    assert r3.peak_memory_bytes["n0/d0"] == max(weights + 400 + 200 + 160 + 1000, weights + 400 + 40 + 4000)


def test_recompute_keeps_less_but_runs_forward_twice():
    g = chain_graph(2, flops=GF, saved=1e6, edge_bytes=1e3)
    c = cluster([[RATE]])
    costs = TableCosts(g, c)
    base = plan([("g", ["l0", "l1"], [("n0/d0", 1.0)])], batch_size=4)
    from dataclasses import replace

    rec = replace(base, groups=(replace(base.groups[0], recompute=True),))
    a, b = simulate(g, c, base, costs), simulate(g, c, rec, costs)
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s + 2 * GF * 4 / RATE)
    pers = 2 * 2 * 4_000_000
    assert a.peak_memory_bytes["n0/d0"] == pers + 2 * 4e6
    # while recomputing, the full activations exist again; outside, only the group's input
    assert b.peak_memory_bytes["n0/d0"] == pers + 4e3 + (2 * 4e6 - 4e3)


def test_parameter_server_sync_is_compute_plus_ps_time_and_loads_the_server_links():
    import dataclasses

    g = chain_graph(2, flops=GF, param_bytes=5_000_000, edge_bytes=0.0)
    c = cluster([[RATE], [RATE], [RATE]], nic_bandwidth=1e9)
    costs = TableCosts(g, c)
    p = plan([("all", ["l0", "l1"], [("n0/d0", 0.5), ("n1/d1", 0.5)])], batch_size=8, sync="ps", bucket_bytes=2**40)
    p = dataclasses.replace(p, groups=(dataclasses.replace(p.groups[0], ps_device="n2/d2"),))
    r = simulate(g, c, p, costs)
    compute = 2 * 3 * GF * 4 / RATE
    ps = costs.ps_sync_time_s(10_000_000, ["n0/d0", "n1/d1"], "n2/d2")
    assert ps == pytest.approx(2 * 2 * 10_000_000 / 1e9)
    update = 1e-9 * 10_000_000  # the server's optimizer step, between gather and scatter
    assert r.iteration_time_s == pytest.approx(compute + ps + update)
    # the server's NIC carries every worker's gradient in and the parameters out
    assert r.link_bytes["n2.nic.down"] == pytest.approx(2 * 10_000_000)
    assert r.link_bytes["n2.nic.up"] == pytest.approx(2 * 10_000_000)
    # the server holds the parameters it serves; its peak includes the bucket buffer
    assert r.persistent_memory_bytes["n2/d2"] == 2 * 10_000_000
    assert r.peak_memory_bytes["n2/d2"] == 2 * 10_000_000 + 10_000_000
    assert r.communication_time_s["n2/d2"] == pytest.approx(ps + update)


@pytest.mark.parametrize("core_nics", [None, 2.0, 1.5, 1.0])
def test_a_switch_core_carries_transfers_side_by_side_up_to_its_bandwidth(core_nics):
    # node 0 → node 1 and node 2 → node 3 share no NIC, only the switch core (if any)
    g = graph(
        [node("s1", GF), node("s2", GF), node("a", GF), node("b", GF)],
        [("s1", "a", 1e6), ("s2", "b", 1e6)],
        batch_size=4,
    )
    c = cluster(
        [[RATE], [RATE], [RATE], [RATE]],
        nic_bandwidth=1e9,
        core_bandwidth=None if core_nics is None else core_nics * 1e9,
    )
    groups = [
        ("g1", ["s1"], [("n0/d0", 1.0)]),
        ("g2", ["s2"], [("n1/d1", 1.0)]),
        ("ga", ["a"], [("n2/d2", 1.0)]),
        ("gb", ["b"], [("n3/d3", 1.0)]),
    ]
    r = simulate(g, c, plan(groups, batch_size=4), TableCosts(g, c))
    fwd = sorted(
        (s, e)
        for name, cat, track, s, e, _op in r.events
        if cat == "transfer" and track in ("n2/d2", "n3/d3") and name.endswith(track)
    )
    t = 4e6 / 1e9
    assert len(fwd) == 2 and fwd[0][0] == pytest.approx(fwd[1][0])  # the NICs work at once
    ends = sorted(e - fwd[0][0] for _, e in fwd)
    assert ends[0] == pytest.approx(t)
    if core_nics is None or core_nics >= 2:
        assert ends[1] == pytest.approx(t)  # the core keeps up
    else:
        assert ends[1] == pytest.approx(2 * 4e6 / (core_nics * 1e9))  # both through the core
