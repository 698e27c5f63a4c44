"""Per-node host speed: a property of the node in the cluster YAML, carried
on the Cluster, and used by the cost model for every device of that node."""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest
from cost_support import transformer_graph

from heterog.cost import build_cost_model
from heterog.cost.predict import predict
from heterog.errors import ClusterError, HeterogWarning
from heterog.hardware.spec import cluster_from_dict, cluster_to_dict, parse_cluster_yaml
from heterog.ir.kinds import Phase

YAML = textwrap.dedent("""\
    name: hosts
    nodes:
      - name: fast
        nic_bandwidth_gbps: 100
        devices: [{type: H200}]
      - name: slow
        nic_bandwidth_gbps: 100
        host_speed: 0.5
        devices: [{type: H200}]
    """)


def _bad(text: str) -> str:
    with pytest.raises(ClusterError) as e:
        parse_cluster_yaml(text, "bad.yaml")
    return str(e.value)


def test_host_speed_is_carried_on_the_node_and_round_trips():
    c = parse_cluster_yaml(YAML, "hosts.yaml")
    assert [n.host_speed for n in c.nodes] == [1.0, 0.5]
    assert c.host_speed("slow/gpu0") == 0.5 and c.host_speed("fast/gpu0") == 1.0
    back = cluster_from_dict(cluster_to_dict(c))
    assert [n.host_speed for n in back.nodes] == [1.0, 0.5]
    assert back.fingerprint() == c.fingerprint()
    # a cluster without host speeds keeps its fingerprint; setting one changes it
    plain = parse_cluster_yaml(YAML.replace("    host_speed: 0.5\n", ""), "plain.yaml")
    assert "host_speed" not in cluster_to_dict(plain)["nodes"][1]
    assert plain.fingerprint() != c.fingerprint()


@pytest.mark.parametrize(
    "value, expect", [("0", "> 0"), ("-2", "> 0"), ("fast", "finite number"), ("1000", "implausible")]
)
def test_bad_host_speed_names_line_and_field(value, expect):
    msg = _bad(YAML.replace("host_speed: 0.5", f"host_speed: {value}"))
    assert "bad.yaml:8" in msg and "nodes[1].host_speed" in msg and expect in msg


def test_unusual_host_speed_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_cluster_yaml(YAML.replace("host_speed: 0.5", "host_speed: 0.1"), "odd.yaml")
    assert any(issubclass(w.category, HeterogWarning) and "odd.yaml:8" in str(w.message) for w in caught)


def test_a_2x_slower_host_slows_host_bound_steps_only():
    """Same GPU type on both nodes: at batch 1 the step is the host's (twice as long on the
    slow node); at a batch large enough to be device-bound it is the GPU's (unchanged)."""
    graph = transformer_graph(layers=2, hidden=256, seq=64, batch=4)
    c = parse_cluster_yaml(YAML, "hosts.yaml")
    m = build_cost_model(graph, c, precision="fp32", optimizer="adamw")
    names = [n.name for n in graph.nodes]

    def compute(dev, b):
        return m.group_time_s(names, dev, b, Phase.FORWARD) + m.group_time_s(names, dev, b, Phase.BACKWARD)

    def step(dev, b):
        return compute(dev, b) + m.optimizer_time_s(names, dev)

    # host-bound nodes take exactly twice as long; the batch-1 step as a whole nearly so (a few
    # nodes and the optimizer's streaming are the device's)
    from heterog.cost.host import host_times_s
    from heterog.hardware.catalog import get_gpu, host_costs

    for phase in Phase:
        host = host_times_s(graph, host_costs(get_gpu("H200")), phase, None)
        fast = m.node_times_s(names, "fast/gpu0", 1, phase)
        slow = m.node_times_s(names, "slow/gpu0", 1, phase)
        bound = fast == host
        assert bound.any()
        assert slow[bound] == pytest.approx(2 * fast[bound])
        assert (slow >= fast).all() and (slow <= 2 * fast + 1e-12).all()
        n0 = names[int(np.argmax(bound))]  # and the per-node answer the simulator reads
        assert m.compute_time_s(n0, "slow/gpu0", 1, phase) == pytest.approx(
            2 * m.compute_time_s(n0, "fast/gpu0", 1, phase)
        )
    assert 1.6 * step("fast/gpu0", 1) < step("slow/gpu0", 1) <= 2 * step("fast/gpu0", 1)
    big = 1 << 17
    assert step("slow/gpu0", big) == pytest.approx(step("fast/gpu0", big), rel=0.02)
    # predict takes the same figure
    p = [predict(graph, batch_size=1, device="H200", host_speed=s)["iteration_time_s"] for s in (1.0, 0.5)]
    assert 1.6 * p[0] < p[1] <= 2 * p[0]


def test_host_speed_does_not_scale_the_cudnn_calls():
    """A convolution's host time on a half-speed node: its framework work twice as long, its
    cuDNN plan look-up the same (cost/host.py says why)."""
    from cost_support import conv_graph

    from heterog.cost.host import host_times_s
    from heterog.hardware.catalog import get_gpu, host_costs

    g = conv_graph()
    c = parse_cluster_yaml(YAML, "hosts.yaml")
    m = build_cost_model(g, c, precision="fp32")
    h = host_costs(get_gpu("H200"))
    base = host_times_s(g, h, Phase.FORWARD, None)[0]
    assert m.compute_time_s("conv1", "fast/gpu0", 1, Phase.FORWARD) == pytest.approx(base + h.cudnn_op_s)
    assert m.compute_time_s("conv1", "slow/gpu0", 1, Phase.FORWARD) == pytest.approx(2 * base + h.cudnn_op_s)


def test_the_simulator_times_a_device_by_its_own_nodes_host():
    """A plan on the slow node's GPU: the simulator's compute time is the cost model's for
    that device (twice the fast node's at batch 1). Fails today: the lowering times every
    device of a class by its representative; adding cluster.host_speed(device) to
    device_class_key fixes it (then remove this marker)."""
    from heterog.simulate import simulate
    from tests.simulate_support import plan

    graph = transformer_graph(layers=2, hidden=256, seq=64, batch=4)
    c = parse_cluster_yaml(YAML, "hosts.yaml")
    m = build_cost_model(graph, c, precision="fp32", optimizer="adamw")
    names = [n.name for n in graph.nodes]
    r = simulate(graph, c, plan([("all", names, [("slow/gpu0", 1.0)])], batch_size=1), m)
    own = m.group_time_s(names, "slow/gpu0", 1, Phase.FORWARD) + m.group_time_s(names, "slow/gpu0", 1, Phase.BACKWARD)
    assert r.compute_time_s["slow/gpu0"] == pytest.approx(own + m.optimizer_time_s(names, "slow/gpu0"), rel=0.05)
