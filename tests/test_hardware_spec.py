"""Catalog and cluster specs: built-ins, round-trips, and errors that name line and field."""

from __future__ import annotations

import textwrap

import pytest

from heterog.errors import ClusterError
from heterog.hardware import catalog, cpu_probe
from heterog.hardware.spec import builtin_clusters, cluster_from_dict, cluster_to_dict, load_cluster, parse_cluster_yaml

REQUIRED = [
    "P100",
    "V100-16GB",
    "V100-32GB",
    "T4",
    "GTX-1080Ti",
    "RTX-2080Ti",
    "Titan-RTX",
    "RTX-3090",
    "RTX-4090",
    "RTX-A6000",
    "A40",
    "A10",
    "A10G",
    "A100-40GB",
    "A100-80GB",
    "L4",
    "L40S",
    "H100-SXM",
    "H100-PCIe",
    "H200",
    "GH200",
    "B200",
    "MI250X",
    "MI300X",
]


def test_catalog_has_every_required_type_with_sources():
    names = [g.name for g in catalog.list_gpus()]
    assert names[: len(REQUIRED)] == REQUIRED or set(REQUIRED) <= set(names)
    for g in catalog.list_gpus():
        assert g.peak_flops_per_s["fp32"] > 0 and g.memory_bytes > 0
        assert {"peak_tflops", "memory", "intra_node_link"} <= set(g.sources), g.name
    h100 = catalog.get_gpu("h100-sxm")
    assert h100.peak_flops_per_s["bf16"] == pytest.approx(989.4e12)
    assert catalog.get_gpu("v100_32gb").name == "V100-32GB"  # case, '_' and '-' ignored


@pytest.mark.parametrize(
    "family,choices",
    [
        ("A100", "A100-40GB, A100-80GB"),
        ("V100", "V100-16GB, V100-32GB"),
        ("H100", "H100-PCIe, H100-SXM"),
        ("rtx", "RTX-2080Ti, RTX-3090"),
    ],
)
def test_a_family_name_is_refused_with_its_choices(family, choices):
    """`A100` used to become A100-40GB silently: it names two types of unlike memory."""
    with pytest.raises(ClusterError, match=f"ambiguous: it could be {choices}"):
        catalog.get_gpu(family)


@pytest.mark.parametrize(
    "spelling,name",
    [
        ("a100-80g", "A100-80GB"),
        ("A100 80GB", "A100-80GB"),
        ("a100 sxm4 80gb", "A100-80GB"),
        ("A100_SXM4_40GB", "A100-40GB"),
        ("h100 sxm", "H100-SXM"),
        ("Titan", "Titan-RTX"),
        ("A10", "A10"),
        ("a6000", "RTX-A6000"),
        ("gh-96", "GH200"),
    ],
)
def test_unambiguous_spellings_are_accepted(spelling, name):
    assert catalog.get_gpu(spelling).name == name


def test_unknown_gpu_suggests_close_names():
    with pytest.raises(ClusterError, match=r"A100-80GB"):
        catalog.get_gpu("A100-90GB")
    with pytest.raises(ClusterError, match=r"Did you mean .*L40S"):
        catalog.get_gpu("L40")


def test_a_cluster_file_naming_a_family_says_where_and_the_choices():
    msg = _bad(GOOD.replace("A100-80GB", "A100"))
    assert "bad.yaml:" in msg and "A100-40GB, A100-80GB" in msg


def test_cpu_type_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROG_CACHE_DIR", str(tmp_path))
    cpu_probe._measure_cpu_for.cache_clear()
    try:
        g = catalog.get_gpu("cpu")
        assert g.vendor == "cpu" and g.peak_flops_per_s["fp32"] > 1e8
        assert g.memory_bandwidth_bytes_per_s > 1e8
        assert (tmp_path / "cpu_probe.json").is_file()
        cpu_probe._measure_cpu_for.cache_clear()
        monkeypatch.setattr(cpu_probe, "_run_probe", lambda: pytest.fail("cache not used"))
        assert catalog.get_gpu("cpu").peak_flops_per_s == g.peak_flops_per_s
    finally:
        cpu_probe._measure_cpu_for.cache_clear()


def test_builtin_clusters():
    assert {"paper-8gpu", "mixed-16", "mixed-64", "scale-1024"} <= set(builtin_clusters())
    paper = load_cluster("paper-8gpu")
    types = sorted(d.gpu_type for d in paper.devices)
    assert types == ["GTX-1080Ti"] * 4 + ["P100"] * 2 + ["V100-16GB"] * 2
    nic_gbps = sorted(n.nic_bandwidth_bytes_per_s * 8 / 1e9 for n in paper.nodes)
    assert nic_gbps == pytest.approx([50, 50, 50, 100])
    assert len(paper.nodes) == 4 and paper.switch_core is None
    m16 = load_cluster("mixed-16")
    assert sorted(d.gpu_type for d in m16.devices).count("T4") == 8 and len(m16.nodes) == 3
    m64 = load_cluster("mixed-64")
    assert len(m64.devices) == 64 and len(m64.nodes) == 8
    assert len({d.gpu_type for d in m64.devices}) == 4
    assert len({n.nic_bandwidth_bytes_per_s for n in m64.nodes}) == 2
    assert len(load_cluster("scale-1024").devices) == 1024


@pytest.mark.parametrize("name", ["paper-8gpu", "mixed-16", "mixed-64", "emulated-4"])
def test_cluster_dict_round_trip(name):
    c = load_cluster(name)
    back = cluster_from_dict(cluster_to_dict(c))
    assert back == c and back.fingerprint() == c.fingerprint()
    import json

    assert cluster_from_dict(json.loads(json.dumps(cluster_to_dict(c)))) == c  # survives JSON


def test_path_and_bottleneck_use_the_nic_across_nodes():
    c = load_cluster("paper-8gpu")
    assert c.bottleneck_bandwidth_bytes_per_s("v100/gpu0", "v100/gpu1") == pytest.approx(150e9)
    assert c.bottleneck_bandwidth_bytes_per_s("v100/gpu0", "gtx0/gpu0") == pytest.approx(50e9 / 8)


GOOD = """\
name: t
nodes:
  - name: a
    nic_bandwidth_gbps: 100
    devices:
      - {type: A100-80GB, count: 2}
  - name: b
    nic_bandwidth_gbps: 50
    devices:
      - {type: T4, count: 2}
"""


def _bad(text: str) -> str:
    with pytest.raises(ClusterError) as e:
        parse_cluster_yaml(textwrap.dedent(text), "bad.yaml")
    return str(e.value)


def test_good_yaml_parses():
    c = parse_cluster_yaml(GOOD, "good.yaml")
    assert [d.name for d in c.devices] == ["a/gpu0", "a/gpu1", "b/gpu0", "b/gpu1"]


def test_unknown_gpu_names_line_and_suggests():
    msg = _bad(GOOD.replace("T4", "T5"))
    assert "bad.yaml:10" in msg and "nodes[1].devices[0].type" in msg and "T4" in msg


def test_negative_bandwidth_names_line_and_field():
    msg = _bad(GOOD.replace("nic_bandwidth_gbps: 50", "nic_bandwidth_gbps: -5"))
    assert "bad.yaml:8" in msg and "nodes[1].nic_bandwidth_gbps" in msg and "> 0" in msg
    assert "> 0" in _bad(GOOD.replace("nic_bandwidth_gbps: 50", "nic_bandwidth_gbps: 0"))


def test_duplicate_node_name():
    msg = _bad(GOOD.replace("name: b", "name: a"))
    assert "bad.yaml:7" in msg and "duplicate node name 'a'" in msg


def test_device_in_two_nodes():
    text = """\
    name: t
    nodes:
      - name: a
        nic_bandwidth_gbps: 100
        devices: [{type: T4, name: shared}]
      - name: b
        nic_bandwidth_gbps: 100
        devices: [{type: T4, name: shared}]
    """
    msg = _bad(text)
    assert "bad.yaml:8" in msg and "'shared' is in two nodes ('a' and 'b')" in msg


def test_duplicate_device_in_one_node():
    msg = _bad("""\
    name: t
    nodes:
      - name: a
        nic_bandwidth_gbps: 100
        devices: [{type: T4, name: x}, {type: T4, name: x}]
    """)
    assert "duplicate device name 'x'" in msg


def test_unknown_field_and_syntax_errors():
    msg = _bad(GOOD.replace("nic_bandwidth_gbps: 100", "nic_bandwith_gbps: 100"))
    assert "bad.yaml:4" in msg and "Did you mean nic_bandwidth_gbps" in msg
    assert "not valid YAML" in _bad("name: t\nnodes: [\n")
    assert "missing required field 'nodes'" in _bad("name: t\n")


def test_emulated_requires_cpu_devices():
    msg = _bad(GOOD.replace("name: t", "name: t\nkind: emulated"))
    assert "type 'cpu'" in msg


def test_load_cluster_unknown_name():
    with pytest.raises(ClusterError, match="not a built-in"):
        load_cluster("no-such-cluster")


@pytest.mark.parametrize(
    "device_name,memory,expected",
    [
        ("NVIDIA H200", None, "H200"),
        ("NVIDIA A100-SXM4-80GB", None, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", None, "A100-40GB"),
        ("NVIDIA A10", None, "A10"),
        ("Tesla V100-SXM2-32GB", None, "V100-32GB"),
        ("NVIDIA H100 80GB HBM3", None, "H100-SXM"),
        ("NVIDIA H100 PCIe", None, "H100-PCIe"),
        ("NVIDIA L4", None, "L4"),
        ("NVIDIA L40S", None, "L40S"),
        ("NVIDIA GeForce RTX 4090", None, "RTX-4090"),
        ("NVIDIA A100 80GB PCIe", 85 * 10**9, "A100-80GB"),
        ("NVIDIA A10G", None, "A10G"),
        ("NVIDIA RTX A6000", None, "RTX-A6000"),
        ("NVIDIA B200", None, "B200"),
        ("NVIDIA GH200 480GB", None, "GH200"),
        ("NVIDIA A40", None, "A40"),
    ],
)
def test_gpu_from_device_name(device_name, memory, expected):
    assert catalog.gpu_from_device_name(device_name, memory).name == expected


def test_gpu_from_unknown_device_name():
    with pytest.raises(ClusterError, match="not in the catalog"):
        catalog.gpu_from_device_name("Voodoo2")
