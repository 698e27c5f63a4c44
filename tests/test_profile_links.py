"""Costs as this machine measures them: the time outside the hooked leaf modules, and the
shaped links as gloo really uses them."""

from __future__ import annotations

import os

import pytest
import torch

from heterog.capture import capture_model
from heterog.cost import build_cost_model
from heterog.cost.profile import LinkCalibratedCosts, LinkCalibration, LinkScope, ProfileError
from heterog.demo import SCENARIOS
from heterog.ir.kinds import Phase
from heterog.ir.plan import ModelSpec
from heterog.profile.measure import WholeStep, attribute_unhooked, measure_profile, profile_batch_sizes
from heterog.workload import resolve_workload

GPT2 = {"hidden": 32, "layers": 1, "heads": 2, "vocab": 512, "positions": 16, "dropout": 0.0}


@pytest.fixture(scope="module")
def gpt2_graph():
    return capture_model("gpt2", GPT2, batch_size=4, seq_len=8)


def test_unhooked_time_goes_to_the_loss_and_the_loose_nodes_by_their_bytes(gpt2_graph):
    g = gpt2_graph
    hooked = {n.name: {"fwd": 0.001, "bwd": 0.002} for n in g.nodes if "::" not in n.name}
    unseen = [n for n in g.nodes if n.name not in hooked]
    losses = [n for n in unseen if str(n.kind) == "loss"]
    assert losses and len(unseen) > len(losses)  # gpt2 has loose adds and a loss
    whole = WholeStep(
        fwd_s=sum(v["fwd"] for v in hooked.values()) + 0.010,
        bwd_s=sum(v["bwd"] for v in hooked.values()) + 0.030,
        loss_fwd_s=0.004,
        loss_bwd_s=0.006,
    )
    out = attribute_unhooked(hooked, whole, g, 4)
    assert set(out) == {n.name for n in g.nodes}
    assert all(out[n] == v for n, v in hooked.items())  # the step had room: hooked kept
    assert sum(out[n.name]["fwd"] for n in losses) == pytest.approx(0.004)
    assert sum(out[n.name]["bwd"] for n in losses) == pytest.approx(0.006)
    # hooked + attributed = the whole step, in each phase
    assert sum(out[n.name]["fwd"] for n in unseen) == pytest.approx(0.010)
    assert sum(out[n.name]["bwd"] for n in unseen) == pytest.approx(0.030)
    assert sum(v["fwd"] for v in out.values()) == pytest.approx(whole.fwd_s)
    others = [n for n in unseen if n not in losses]
    a, b = sorted(others, key=lambda n: n.fwd_bytes.at(4))[-2:]
    assert out[a.name]["fwd"] / out[b.name]["fwd"] == pytest.approx(a.fwd_bytes.at(4) / b.fwd_bytes.at(4))


def test_hooks_seeing_more_than_the_whole_step_are_scaled_down_to_it(gpt2_graph):
    hooked = {n.name: {"fwd": 1.0, "bwd": 2.0} for n in gpt2_graph.nodes if "::" not in n.name}
    out = attribute_unhooked(hooked, WholeStep(fwd_s=0.5, bwd_s=0.5, loss_fwd_s=0.1, loss_bwd_s=0.2), gpt2_graph, 4)
    assert all(t >= 0 for v in out.values() for t in v.values())
    for phase in ("fwd", "bwd"):  # the step as measured without hooks, loss included
        assert sum(v[phase] for v in out.values()) == pytest.approx(0.5)
    some = next(iter(hooked))  # all that the loss leaves, shared as the hooks saw it
    assert out[some]["fwd"] == pytest.approx(0.4 / len(hooked))
    assert out[some]["bwd"] == pytest.approx(0.3 / len(hooked))


def test_profile_batch_sizes_are_dense_where_the_cpu_is_not_linear():
    assert profile_batch_sizes(96) == (1, 2, 4, 8, 16, 24, 32, 64, 96)
    assert profile_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert profile_batch_sizes(1) == (1,)


def test_a_profile_with_the_graph_times_every_node_and_sums_to_the_step(gpt2_graph):
    torch.manual_seed(0)
    work = resolve_workload(ModelSpec(name="gpt2", args=GPT2, seq_len=8))
    prof = measure_profile(work, batch_sizes=(4,), repeats=3, graph=gpt2_graph)
    assert set(prof.times) == {n.name for n in gpt2_graph.nodes}  # none left to the estimate
    costs = build_cost_model(gpt2_graph, SCENARIOS["lm-slow-link"].cluster(), profile=prof)
    names = [n.name for n in gpt2_graph.nodes]
    assert costs.group_time_s(names, "a/cpu0", 4, Phase.BACKWARD) > 0


def _calibrated(one_way=0.5, duplex=0.25, latency_s=0.0):
    sc = SCENARIOS["lm-slow-link"]
    cluster = sc.cluster()
    graph = capture_model("gpt2", GPT2, batch_size=4, seq_len=8)
    base = build_cost_model(graph, cluster)
    cal = LinkCalibration(node="b", one_way_efficiency=one_way, duplex_efficiency=duplex, latency_s=latency_s)
    return cluster, graph, base, LinkCalibratedCosts(base, cluster, (cal,))


def test_calibrated_links_slow_only_what_crosses_the_measured_nic():
    cluster, _, base, costs = _calibrated()
    big = 64 * 2**20
    # across node b's NIC: half the bandwidth one way, a quarter when two members exchange both ways
    assert costs.transfer_time_s(big, "a/cpu0", "b/cpu0") == pytest.approx(
        2 * base.transfer_time_s(big, "a/cpu0", "b/cpu0"), rel=0.01
    )
    assert costs.collective_time_s("allreduce", big, ["a/cpu0", "b/cpu0"]) == pytest.approx(
        4 * base.collective_time_s("allreduce", big, ["a/cpu0", "b/cpu0"]), rel=0.01
    )
    # three members: two connections per member, each one way (the one-way rate)
    three = ["a/cpu0", "a/cpu1", "b/cpu0"]
    assert costs.collective_time_s("allreduce", big, three) == pytest.approx(
        2 * base.collective_time_s("allreduce", big, three), rel=0.01
    )
    assert costs.ps_sync_time_s(big, ["a/cpu0", "b/cpu0"], "b/cpu0") == pytest.approx(
        2 * base.ps_sync_time_s(big, ["a/cpu0", "b/cpu0"], "b/cpu0"), rel=0.01
    )
    # inside node a nothing changes, and neither does compute
    assert costs.transfer_time_s(big, "a/cpu0", "a/cpu1") == base.transfer_time_s(big, "a/cpu0", "a/cpu1")
    assert costs.collective_time_s("allreduce", big, ["a/cpu0", "a/cpu1"]) == pytest.approx(
        base.collective_time_s("allreduce", big, ["a/cpu0", "a/cpu1"])
    )
    n = next(iter(base.graph.index))
    assert costs.compute_time_s(n, "a/cpu0", 4, Phase.FORWARD) == base.compute_time_s(n, "a/cpu0", 4, Phase.FORWARD)
    # the p2p time is the closed form on the measured rate
    bw = cluster.bottleneck_bandwidth_bytes_per_s("a/cpu0", "b/cpu0") * 0.5
    assert costs.transfer_time_s(big, "a/cpu0", "b/cpu0") == pytest.approx(
        cluster.latency_s("a/cpu0", "b/cpu0") + big / bw, rel=1e-6
    )


def test_an_intra_node_calibration_slows_only_the_node_s_own_ports():
    sc = SCENARIOS["lm-slow-link"]
    cluster = sc.cluster()
    base = build_cost_model(capture_model("gpt2", GPT2, batch_size=4, seq_len=8), cluster)
    cal = LinkCalibration(
        node="a", one_way_efficiency=0.5, duplex_efficiency=0.25, latency_s=0.0, scope=LinkScope.INTRA
    )
    costs = LinkCalibratedCosts(base, cluster, (cal,))
    big = 64 * 2**20
    pair = ["a/cpu0", "a/cpu1"]
    assert costs.transfer_time_s(big, *pair) == pytest.approx(2 * base.transfer_time_s(big, *pair), rel=0.01)
    assert costs.collective_time_s("allreduce", big, pair) == pytest.approx(
        4 * base.collective_time_s("allreduce", big, pair), rel=0.01
    )
    # across b's NIC (25 MB/s) the loopback ports are nowhere near the bottleneck
    assert costs.transfer_time_s(big, "a/cpu0", "b/cpu0") == pytest.approx(
        base.transfer_time_s(big, "a/cpu0", "b/cpu0"), rel=0.01
    )


def test_loopback_between_two_ranks_is_measured_without_root():
    from heterog.profile.links import LinkMeasurementError, calibrate_links, measure_intra_link

    cluster = SCENARIOS["lm-slow-link"].cluster()
    ((cal, m),) = calibrate_links(cluster, nics=False)
    assert (cal.node, cal.scope) == ("a", LinkScope.INTRA)
    assert m.nominal_bandwidth_bytes_per_s == pytest.approx(2e9)  # the cpu type's declared rate
    assert m.one_way_bandwidth_bytes_per_s > 1e7 and m.ring_bandwidth_bytes_per_s > 1e7
    with pytest.raises(LinkMeasurementError, match="not two devices of one node"):
        measure_intra_link(cluster, "a/cpu0", "b/cpu0")


def test_the_simulator_and_planner_take_calibrated_costs():
    from heterog.search.planner import plan_graph
    from heterog.simulate.simulator import simulate

    cluster, graph, base, costs = _calibrated()
    result = plan_graph(
        graph, cluster, costs, budget_s=1.0, model_spec=ModelSpec(name="gpt2", args=GPT2, batch_size=4, seq_len=8)
    )
    even = next(c for c in result.candidates if c.strategy == "even-dp-allreduce")
    slow = simulate(graph, cluster, even.plan, costs, timeline=False).iteration_time_s
    fast = simulate(graph, cluster, even.plan, base, timeline=False).iteration_time_s
    assert slow > fast  # its gradients cross b's NIC, measured slower than declared


def test_a_calibration_says_what_is_wrong():
    with pytest.raises(ProfileError, match="plausible"):
        LinkCalibration(node="b", one_way_efficiency=0.0, duplex_efficiency=0.5, latency_s=0.0)
    cluster, _, base, _ = _calibrated()
    with pytest.raises(ProfileError, match="does not have"):
        LinkCalibratedCosts(
            base, cluster, (LinkCalibration(node="zz", one_way_efficiency=0.9, duplex_efficiency=0.8, latency_s=0.0),)
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_shaped_link_carries_about_its_rate_and_less_both_ways():
    from heterog.execute.netns import leftover_namespaces
    from heterog.profile.links import measure_shaped_link

    cluster = SCENARIOS["lm-slow-link"].cluster()  # node b: 0.2 Gb/s = 25 MB/s
    m = measure_shaped_link(cluster, "a/cpu0", "b/cpu0")
    assert m.nominal_bandwidth_bytes_per_s == pytest.approx(25e6)
    # TBF holds the rate: a one-way stream gets no more than ~the rate, and not far less
    assert 0.6 < m.efficiency < 1.15
    # a ring step sends and receives at once: each direction no faster than one way alone
    assert m.ring_bandwidth_bytes_per_s < 1.1 * m.one_way_bandwidth_bytes_per_s
    assert not [ns for ns in leftover_namespaces() if ns.startswith("hg")]
