"""Prices per device-hour: the catalog's list prices with their sources, a cluster file's
`price_per_hour` (per type, node or device entry), the JSON round trip, and clear errors."""

import json
import warnings

import pytest
from typer.testing import CliRunner

from heterog.cli.main import run_cli
from heterog.errors import ClusterError, HeterogWarning, PlanError
from heterog.hardware.catalog import list_gpus
from heterog.hardware.spec import cluster_from_dict, cluster_to_dict, load_cluster, parse_cluster_yaml, with_prices
from heterog.search.objective import Goal, check_priced

SPEC = """
name: priced
price_per_hour: {T4: 0.35}
nodes:
  - name: a
    nic_bandwidth_gbps: 100
    price_per_hour: 12.0
    devices: [{type: A100-80GB, count: 4}]
  - name: b
    nic_bandwidth_gbps: 100
    devices:
      - {type: T4, count: 2}
      - {type: V100-16GB, count: 1, price_per_hour: 0.9}
"""


def test_catalog_prices_name_their_page_and_date():
    priced = [g for g in list_gpus() if g.price is not None]
    assert len(priced) >= 8
    for g in priced:
        assert g.price.usd_per_hour > 0 and g.price.source.startswith(("Lambda", "Modal"))
        assert "https://" in g.price.source and len(g.price.date) == 10
    assert next(g for g in list_gpus() if g.name == "GTX-1080Ti").price is None  # none found: left unpriced


def test_type_node_and_device_prices_and_their_round_trip():
    c = parse_cluster_yaml(SPEC, "priced.yaml")
    price = {d.name: c.price_per_hour(d.name) for d in c.devices}
    assert price == {"a/gpu0": 3.0, "a/gpu1": 3.0, "a/gpu2": 3.0, "a/gpu3": 3.0} | {
        "b/gpu0": 0.35,
        "b/gpu1": 0.35,
        "b/gpu2": 0.9,
    }
    back = cluster_from_dict(json.loads(json.dumps(cluster_to_dict(c))))
    assert back == c and back.gpu_types["A100-80GB"].price == c.gpu_types["A100-80GB"].price
    assert load_cluster("mixed-16").price_per_hour("t4/gpu0") == pytest.approx(0.5904)  # the catalog's
    cheaper = with_prices(c, {"t4": 0.1})
    assert cheaper.price_per_hour("b/gpu0") == 0.1 and cheaper.price_per_hour("a/gpu0") == 3.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("price_per_hour: {T4: -1}", "priced.yaml:3: field price_per_hour.T4: must be ≥ 0"),
        ("price_per_hour: {T4: cheap}", "price_per_hour.T4: expected a finite number, found 'cheap'"),
        ("price_per_hour: {Tesla-T5: 1}", "unknown GPU type 'Tesla-T5'"),
        ("price_per_hour: {P100: 1}", "prices type(s) P100, which no device of this cluster has"),
        ("price_per_hour: 3", "expected a mapping of GPU type → US dollars per device-hour"),
    ],
)
def test_bad_prices_say_what_and_where(change, message):
    with pytest.raises(ClusterError) as e:
        parse_cluster_yaml(SPEC.replace("price_per_hour: {T4: 0.35}", change), "priced.yaml")
    assert message in str(e.value)


def test_a_node_priced_twice_and_an_implausible_price():
    twice = SPEC.replace("{type: A100-80GB, count: 4}", "{type: A100-80GB, count: 4, price_per_hour: 1}")
    with pytest.raises(ClusterError, match="nodes\\[0\\].price_per_hour: priced twice"):
        parse_cluster_yaml(twice, "priced.yaml")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        parse_cluster_yaml(SPEC.replace("0.9}", "900}"), "priced.yaml")
    assert any(isinstance(x.message, HeterogWarning) and "900 $/h" in str(x.message) for x in w)


def test_cost_objective_on_unpriced_devices_says_how_to_price_them():
    with pytest.raises(PlanError) as e:
        check_priced(load_cluster("paper-8gpu"), Goal(objective="cost"))
    msg = str(e.value)
    assert "V100-16GB (2 devices), GTX-1080Ti (4 devices), P100 (2 devices)" in msg and "--price" in msg
    check_priced(load_cluster("paper-8gpu"), Goal())  # the time objective needs no prices
    for bad, said in (({"objective": "money"}, "one of time, cost"), ({"tolerance": 1.5}, "in [0, 1)")):
        with pytest.raises(PlanError, match=said.replace("[", "\\[").replace("(", "\\(").replace(")", "\\)")):
            Goal(**bad)
    with pytest.raises(PlanError, match="positive number of US dollars"):
        Goal(max_cost_per_hour=-1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--objective", "cost"], "has none for V100-32GB (4 devices)"),
        (["--price", "T4=free"], "write TYPE=USD"),
        (["--price", "Tesla-T5=1"], "unknown GPU type 'Tesla-T5'"),
        (["--objective", "money"], "must be one of time, cost"),
    ],
)
def test_the_command_line_refuses_bad_prices_before_planning(args, message):
    with CliRunner().isolation() as (out, err, *_):
        code = run_cli(["plan", "--model", "mlp", "--batch-size", "8", "--cluster", "mixed-16", *args])
        text = out.getvalue().decode() + err.getvalue().decode()
    assert code != 0 and message in " ".join(text.split()) and "Traceback" not in text, text
