"""`heterog capture` and `heterog models`: JSON keys, files written, one-paragraph errors."""

import json
import os
import subprocess
import sys

import pytest

from heterog.ir.opgraph import OpGraph

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _heterog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "heterog.cli.main", *args], capture_output=True, text=True, env=ENV, timeout=240
    )


def test_capture_json_and_out(tmp_path):
    out = tmp_path / "graph.json"
    r = _heterog(
        "capture",
        "--model",
        "gpt2",
        "--model-arg",
        "layers=2",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--json",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in (
        "model",
        "batch_size",
        "seq_len",
        "num_nodes",
        "num_parameters",
        "forward_flops",
        "backward_flops",
        "saved_activation_bytes",
    ):
        assert key in doc
    assert doc["model"] == "gpt2" and doc["batch_size"] == 2 and doc["seq_len"] == 32
    graph = OpGraph.load(out)
    assert len(graph.nodes) == doc["num_nodes"] and graph.num_parameters == doc["num_parameters"]
    assert graph.forward_flops() == pytest.approx(doc["forward_flops"])


def test_capture_human_summary():
    r = _heterog("capture", "--model", "toy-cnn", "--batch-size", "4")
    assert r.returncode == 0, r.stderr
    assert "conv1" in r.stdout and "parameters" in r.stdout


def test_models_json_lists_counts():
    r = _heterog("models", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["resnet50"]["num_parameters"] == 25_557_032
    assert rows["vgg19"]["num_parameters"] == 143_667_240
    assert rows["gpt2-xl"]["num_parameters"] == 1_557_611_200


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "resnet51", "--batch-size", "2"], "Known models: resnet50"),
        (["--model", "mlp", "--model-arg", "depth", "--batch-size", "2"], "key=value"),
        (["--model", "mlp", "--model-arg", "depth=3", "--batch-size", "2"], "accepts in_features"),
    ],
)
def test_bad_input_is_one_paragraph(args, needle):
    r = _heterog("capture", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1


def test_failing_factory_and_wrong_shapes(tmp_path):
    file = tmp_path / "m.py"
    file.write_text(
        "import torch\nfrom torch import nn\n"
        "def broken():\n    raise ValueError('checkpoint missing')\n"
        "def linear():\n    return nn.Linear(7, 2)\n"
        "def example_batch(batch_size, seq_len):\n"
        "    return (torch.randn(batch_size, 5),), torch.randint(0, 2, (batch_size,))\n"
    )
    r = _heterog("capture", "--model", f"{file}:broken", "--batch-size", "2")
    assert r.returncode == 2 and "checkpoint missing" in r.stderr and "Traceback" not in r.stderr
    r = _heterog("capture", "--model", f"{file}:linear", "--batch-size", "2")
    assert r.returncode == 2 and "(2, 5)" in r.stderr and "Traceback" not in r.stderr
    r = _heterog("--debug", "capture", "--model", f"{file}:linear", "--batch-size", "2")
    assert "Traceback" in r.stderr
