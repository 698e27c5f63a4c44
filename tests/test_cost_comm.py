"""Collective formulas against hand-computed cases on small clusters."""

from __future__ import annotations

import pytest

from heterog.cost import comm
from heterog.hardware.spec import parse_cluster_yaml

# two nodes × 4 A100 (NVLink 300 GB/s per direction), NIC 100 Gb/s = 12.5 GB/s; latencies 0
TWO_NODES = """\
name: two
nodes:
  - name: a
    nic_bandwidth_gbps: 100
    nic_latency_us: 0
    intra_latency_us: 0
    devices: [{type: A100-80GB, count: 4}]
  - name: b
    nic_bandwidth_gbps: 100
    nic_latency_us: 0
    intra_latency_us: 0
    devices: [{type: A100-80GB, count: 4}]
"""
NVLINK = 300e9
NIC = 12.5e9
N = 64e6


@pytest.fixture(scope="module")
def cluster():
    return parse_cluster_yaml(TWO_NODES)


def devs(c, node=None):
    return [d.name for d in c.devices if node is None or d.node == node]


def test_p2p_alpha_beta():
    c = parse_cluster_yaml(TWO_NODES.replace("nic_latency_us: 0", "nic_latency_us: 10", 1))
    # a → b crosses a's NIC (latency 10 µs split 5 + 5 over up/down links, only 'up' is a's)
    t = comm.p2p_time_s(c, N, "a/gpu0", "b/gpu0")
    assert t == pytest.approx(5e-6 + N / NIC)
    assert comm.p2p_time_s(c, N, "a/gpu0", "a/gpu0") == 0.0


def test_ring_inside_a_node_uses_nvlink(cluster):
    n = 4
    expected = 2 * (n - 1) / n * N / NVLINK
    assert comm.collective_time_s(cluster, "allreduce", N, devs(cluster, "a")) == pytest.approx(expected)
    assert comm.collective_time_s(cluster, "reduce_scatter", N, devs(cluster, "a")) == pytest.approx(expected / 2)
    assert comm.collective_time_s(cluster, "all_gather", N, devs(cluster, "a")) == pytest.approx(expected / 2)


def test_ring_across_two_nodes_is_limited_by_the_nic(cluster):
    n = 8
    t = comm.collective_time_s(cluster, "allreduce", N, devs(cluster))
    assert t == pytest.approx(2 * (n - 1) / n * N / NIC)  # not N / NVLINK
    assert t > 20 * comm.collective_time_s(cluster, "allreduce", N, devs(cluster, "a"))


def test_badly_ordered_ring_still_leaves_each_node_once(cluster):
    mixed = ["a/gpu0", "b/gpu0", "a/gpu1", "b/gpu1"]
    assert comm.ring_order(cluster, mixed) == ["a/gpu0", "a/gpu1", "b/gpu0", "b/gpu1"]


def test_ring_latency_term():
    c = parse_cluster_yaml(TWO_NODES.replace("intra_latency_us: 0", "intra_latency_us: 4"))
    members = [d.name for d in c.devices if d.node == "a"]
    t = comm.collective_time_s(c, "allreduce", 8.0, members)
    # 2(n-1) steps, each 4 µs (2 µs up + 2 µs down) plus a negligible 2-byte chunk
    assert t == pytest.approx(6 * 4e-6, rel=1e-3)


def test_parameter_server_is_limited_by_the_server(cluster):
    members = devs(cluster)
    server = "a/gpu0"
    # 3 local replicas share the server's port (300 GB/s); 4 remote ones share its NIC:
    # the NIC carries 4·N each way.
    t = comm.ps_sync_time_s(cluster, N, members, server)
    assert t == pytest.approx(2 * 4 * N / NIC)
    # one node only: the server's port carries 3·N each way
    assert comm.ps_sync_time_s(cluster, N, devs(cluster, "a"), server) == pytest.approx(2 * 3 * N / NVLINK)


def test_tree_and_hierarchical(cluster):
    members = devs(cluster)
    ring = comm.collective_time_s(cluster, "allreduce", N, members, "ring")
    tree = comm.collective_time_s(cluster, "allreduce", N, members, "tree")
    hier = comm.collective_time_s(cluster, "allreduce", N, members, "hierarchical")
    # tree: one inter-node edge carrying N/2 each way in each phase: 2·(N/2)/NIC
    assert tree == pytest.approx(N / NIC)
    # hierarchical: intra reduce-scatter + all-gather on NVLink, the whole buffer over the
    # NIC in a 2-node ring: 2·(2-1)/2 · N / NIC
    intra = 3 / 4 * N / NVLINK
    assert hier == pytest.approx(2 * intra + N / NIC)
    assert ring > 0 and hier < ring * 1.01 + 2 * intra
    with pytest.raises(Exception, match="unknown collective method"):
        comm.collective_time_s(cluster, "allreduce", N, members, "butterfly")


def test_hierarchical_wins_on_latency_for_small_messages():
    c = parse_cluster_yaml(TWO_NODES.replace("nic_latency_us: 0", "nic_latency_us: 20"))
    members = [d.name for d in c.devices]
    ring = comm.collective_time_s(c, "allreduce", 1024.0, members, "ring")
    hier = comm.collective_time_s(c, "allreduce", 1024.0, members, "hierarchical")
    assert hier < ring


def test_single_member_costs_nothing(cluster):
    for method in comm.METHODS:
        assert comm.collective_time_s(cluster, "allreduce", N, ["a/gpu0"], method) == 0.0
    assert comm.ps_sync_time_s(cluster, N, ["a/gpu0"], "a/gpu0") == 0.0


def test_cost_model_collectives_match_the_formulas_at_any_size():
    """AnalyticCostModel caches each collective as affine in the bytes; check it is exact."""
    import numpy as np
    from cost_support import transformer_graph

    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster

    c = load_cluster("mixed-64")
    m = build_cost_model(transformer_graph(layers=1), c)
    members = [d.name for d in c.devices][::3]
    for nbytes in (1.0, 1e3, 3.3e6, 7e8):
        for method in comm.METHODS:
            for op in ("allreduce", "all_gather", "broadcast"):
                assert m.collective_time_s(op, nbytes, members, method) == pytest.approx(
                    comm.collective_time_s(c, op, nbytes, members, method), rel=1e-9
                )
        assert m.ps_sync_time_s(nbytes, members, members[1]) == pytest.approx(
            comm.ps_sync_time_s(c, nbytes, members, members[1]), rel=1e-9
        )
    assert m.collective_time_s("allreduce", 0.0, members) == 0.0
    assert np.isfinite(m.collective_time_s("allreduce", 1e9, members, "hierarchical"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uneven_shard_rings_are_timed_as_their_steps_one_by_one(seed):
    """shard_collective_time_s computes every step at once; here each step's transfers go
    through step_time_s one by one (the definition), on random members of mixed-64 — some
    owning nothing — for both collectives."""
    import random

    from heterog.hardware.spec import load_cluster
    from heterog.ir.plan import shard_piece

    c = load_cluster("mixed-64")
    rng = random.Random(seed)
    members = rng.sample(sorted(c.device_index), rng.randint(2, 40))
    weights = [rng.random() if rng.random() > 0.2 else 0.0 for _ in members]
    fractions = [w / (sum(weights) or 1.0) for w in weights]
    share = dict(zip(members, fractions))
    ring = comm.ring_order(c, members)
    n, nbytes = len(ring), 3e8
    for op in ("reduce_scatter", "all_gather"):
        want = sum(
            comm.step_time_s(
                c, ((ring[i], ring[(i + 1) % n], share[ring[shard_piece(op, i, k, n)]] * nbytes) for i in range(n))
            )
            for k in range(n - 1)
        )
        assert comm.shard_collective_time_s(c, op, nbytes, members, fractions) == pytest.approx(want, rel=1e-12)
