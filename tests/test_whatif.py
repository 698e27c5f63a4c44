"""heterog whatif: clusters changed as asked, each planned beside even data parallelism."""

from __future__ import annotations

import pytest

from heterog.cluster_change import Change, changed_cluster, parse_changes, whatif
from heterog.errors import PlanError
from heterog.hardware.spec import load_cluster


def _types(cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in cluster.devices:
        out[d.gpu_type] = out.get(d.gpu_type, 0) + 1
    return out


def test_devices_are_added_as_a_node_and_removed_from_the_fullest_nodes() -> None:
    base = load_cluster("paper-8gpu")
    assert parse_changes("T4:4,V100-16GB") == [Change(gpu_type="T4", count=4), Change(gpu_type="V100-16GB", count=1)]
    bigger = changed_cluster(base, parse_changes("t4:4"))  # catalog spelling, any case
    assert _types(bigger) == {**_types(base), "T4": 4}
    new = bigger.nodes[-1]
    assert len(new.devices) == 4 and new.nic_bandwidth_bytes_per_s == max(
        n.nic_bandwidth_bytes_per_s for n in base.nodes
    )
    slower = changed_cluster(base, parse_changes("T4:2", remove=False), nic_gbps=10)
    assert slower.nodes[-1].nic_bandwidth_bytes_per_s == pytest.approx(10e9 / 8)

    smaller = changed_cluster(base, parse_changes("GTX-1080Ti:4", remove=True))
    assert "GTX-1080Ti" not in _types(smaller) and len(smaller.nodes) < len(base.nodes)  # an emptied node goes
    with pytest.raises(PlanError, match="has 2 P100"):
        changed_cluster(base, parse_changes("P100:3", remove=True))
    with pytest.raises(PlanError, match="Did you mean T4"):
        changed_cluster(base, parse_changes("T5:1"))
    with pytest.raises(PlanError, match="whole number"):
        parse_changes("T4:four")


def test_each_change_is_planned_and_compared_with_the_cluster_as_it_is() -> None:
    w = whatif("toy-cnn", batch_size=32, cluster="paper-8gpu", add="T4:4", remove="P100:1", budget_s=2, max_iters=8)
    assert [len(s.changes) for s in w.scenarios] == [1, 1]
    assert {s.devices for s in w.scenarios} == {12, 7} and w.base.devices == 8
    for s in (w.base, *w.scenarios):
        assert s.plan_time_s is not None and s.plan_time_s > 0
        assert s.even_dp_time_s is None or s.even_dp_time_s >= s.plan_time_s * 0.999  # never worse than a baseline
        assert w.speedup(s, "plan") == pytest.approx(w.base.plan_time_s / s.plan_time_s)
    times = [s.plan_time_s for s in w.scenarios]
    assert times == sorted(times)  # ranked
    doc = w.to_dict()
    assert doc["kind"] == "heterog.WhatIf" and doc["scenarios"][0]["plan"]["strategy"]
