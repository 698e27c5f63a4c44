"""The PCIe calibration (cost/pcie.py): the shipped figures load, collectives and transfers over
a calibrated type's catalog PCIe ports use them, and every other link keeps what the cluster says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from heterog.cost import comm, pcie
from heterog.errors import ClusterError
from heterog.hardware.spec import parse_cluster_yaml

ROOT = Path(__file__).resolve().parent.parent
N = 8e6


def node_of(gpu: str, count: int = 4, extra: str = "") -> str:
    return f"""\
name: one
nodes:
  - name: a
    nic_bandwidth_gbps: 50
    intra_latency_us: 3
    devices: [{{type: {gpu}, count: {count}{extra}}}]
"""


def ring_allreduce_s(n: int, bandwidth: float, latency: float) -> float:
    return 2 * (n - 1) * (latency + N / n / bandwidth)


def names(cluster) -> list[str]:
    return [d.name for d in cluster.devices]


def test_the_shipped_t4_calibration_loads_with_its_source():
    cal = pcie.calibrations()["T4"]
    assert 1e9 < cal.bandwidth_bytes_per_s < 15.75e9  # below the data sheet's PCIe Gen3 x16
    assert 3e-6 < cal.latency_s < 1e-3
    assert "amp_iterations.py --fit" in cal.source


def test_a_t4_node_runs_its_collectives_and_transfers_at_the_calibrated_figures():
    cal = pcie.calibrations()["T4"]
    c = parse_cluster_yaml(node_of("T4"))
    expected = ring_allreduce_s(4, cal.bandwidth_bytes_per_s, cal.latency_s)
    assert comm.collective_time_s(c, "allreduce", N, names(c)) == pytest.approx(expected)
    a, b = names(c)[:2]
    assert comm.p2p_time_s(c, N, a, b) == pytest.approx(cal.latency_s + N / cal.bandwidth_bytes_per_s)


@pytest.mark.parametrize(
    ("gpu", "extra", "bandwidth"),
    [
        ("V100-32GB", "", 150e9),  # NVLink: not a PCIe port
        ("A10G", "", None),  # PCIe, but its type is not calibrated: the catalog's rate
        ("T4", ", intra_bandwidth_gbytes_per_s: 12", 12e9),  # the cluster file declares its ports
    ],
)
def test_other_links_keep_what_the_cluster_declares(gpu, extra, bandwidth):
    c = parse_cluster_yaml(node_of(gpu, extra=extra))
    declared = bandwidth or c.gpu(names(c)[0]).intra_node_bandwidth_bytes_per_s
    expected = ring_allreduce_s(4, declared, 3e-6)
    assert comm.collective_time_s(c, "allreduce", N, names(c)) == pytest.approx(expected)


def test_a_malformed_calibration_names_what_is_wrong():
    with pytest.raises(ClusterError, match=r"links\[0\] needs gpu_type"):
        pcie.parse({"schema_version": 1, "links": [{"gpu_type": "T4"}]}, "x.json")
    entry = {"gpu_type": "T4", "bandwidth_gbytes_per_s": 5, "latency_us": 100, "source": "s"}
    with pytest.raises(ClusterError, match="calibrated twice"):
        pcie.parse({"schema_version": 1, "links": [entry, entry]}, "x.json")
    with pytest.raises(ClusterError, match="bandwidth_bytes_per_s must be > 0"):
        pcie.parse({"schema_version": 1, "links": [{**entry, "bandwidth_gbytes_per_s": 0}]}, "x.json")


def test_the_benchmark_check_predicts_one_run_per_tensor_parallel_degree():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "amp_iterations.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("tp ")] == ["1", "2", "4"]


def test_a_sharded_collective_on_t4s_runs_at_the_calibrated_figures():
    cal = pcie.calibrations()["T4"]
    c = parse_cluster_yaml(node_of("T4"))
    even = comm.shard_collective_time_s(c, "all_gather", N, names(c), [0.25] * 4)
    assert even == pytest.approx(3 * (cal.latency_s + N / 4 / cal.bandwidth_bytes_per_s))
