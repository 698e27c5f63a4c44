"""A corpus of bad invocations and bad files: each must end with a non-zero exit code, no
traceback and a message under 10 lines (usage mistakes: exit 2, one paragraph).

The cases run in-process through heterog.cli.main.run_cli (the `heterog` entry point's body)
under typer's CliRunner isolation, so the corpus takes seconds; a few run as real
subprocesses to check the exit codes a shell sees. Every `run` case fails before any rank
starts (the checks in execute/preflight.py and checkpoint.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from heterog.cli.main import run_cli

PLAN_ARGS = ["--model", "mlp", "--batch-size", "8", "--cluster", "emulated-4"]

GOOD_CLUSTER = """\
name: two
kind: emulated
nodes:
  - name: n0
    nic_bandwidth_gbps: 10
    devices:
      - {type: cpu, count: 2}
"""

BAD_CLUSTERS = {
    "yaml_syntax": "name: x\nnodes: [\n",
    "unknown_field": GOOD_CLUSTER.replace("nic_bandwidth_gbps: 10", "nic_bandwith_gbps: 10"),
    "absurd_bandwidth": GOOD_CLUSTER.replace("nic_bandwidth_gbps: 10", "nic_bandwidth_gbps: 1e11"),
    "zero_memory": GOOD_CLUSTER.replace("{type: cpu, count: 2}", "{type: cpu, count: 2, memory_gib: 0}"),
    "unknown_gpu": "name: x\nnodes:\n  - name: n0\n    nic_bandwidth_gbps: 100\n    devices: [{type: h900}]\n",
    "no_nodes": "name: x\n",
    "negative_latency": GOOD_CLUSTER.replace(
        "nic_bandwidth_gbps: 10", "nic_bandwidth_gbps: 10\n    nic_latency_us: -5"
    ),
    "duplicate_nodes": GOOD_CLUSTER + "  - name: n0\n    nic_bandwidth_gbps: 10\n    devices: [{type: cpu}]\n",
    "emulated_gpu": GOOD_CLUSTER.replace("type: cpu", "type: h100"),
    "absurd_slowdown": GOOD_CLUSTER.replace("{type: cpu, count: 2}", "{type: cpu, count: 2, slowdown: 1e6}"),
}

USER_MODELS = {
    "syntax_error": "def net(:\n",
    "no_example_batch": "from torch import nn\ndef net():\n    return nn.Linear(4, 2)\n",
    "factory_raises": (
        "import torch\ndef net():\n    raise ValueError('no weights here')\n"
        "def example_batch(b):\n    return (torch.zeros(b, 4),), torch.zeros(b, dtype=torch.long)\n"
    ),
    "import_error": "import no_such_package_xyz\n",
}

DATA_FILES = {
    "not_iterable": "def loader(batch_size):\n    return 42\n",
    "not_pairs": "import torch\ndef loader(batch_size):\n    return [torch.zeros(batch_size, 16)] * 3\n",
    "wrong_batch": (
        "import torch\ndef loader(batch_size):\n"
        "    return [((torch.zeros(5, 16),), torch.zeros(5, dtype=torch.long))]\n"
    ),
    "empty": "def loader(batch_size):\n    return []\n",
    "raises": "def loader(batch_size):\n    raise OSError('dataset not mounted')\n",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A good plan of the zoo mlp, and every bad file the corpus feeds to heterog."""
    d = tmp_path_factory.mktemp("corpus")
    out: dict[str, Path] = {"dir": d}
    code = _invoke(
        ["plan", *PLAN_ARGS, "--budget-s", "1", "--no-gnn", "--max-iters", "3", "--out", str(d / "plan.json")]
    )
    assert code[0] == 0, code[1]
    out["plan"] = d / "plan.json"
    good = json.loads(out["plan"].read_text())
    for name, text in BAD_CLUSTERS.items():
        (d / f"cluster_{name}.yaml").write_text(text)
    (d / "not_json.json").write_text("{ this is not json")
    (d / "graph_kind.json").write_text(json.dumps({"kind": "heterog.OpGraph", "version": 1}))
    (d / "plan_v99.json").write_text(json.dumps({**good, "version": 99}))
    (d / "plan_no_groups.json").write_text(json.dumps({k: v for k, v in good.items() if k != "groups"}))
    bad_shares = json.loads(json.dumps(good))
    bad_shares["groups"][0]["replicas"] = [[r[0], 0.3] for r in bad_shares["groups"][0]["replicas"]] or [["x", 0.3]]
    (d / "plan_shares.json").write_text(json.dumps(bad_shares))
    other = json.loads(json.dumps(good))
    other["model"]["args"] = {"hidden": 8, "layers": 5}  # another mlp: the plan's nodes do not fit
    other["graph_fingerprint"] = "0123456789abcdef"
    (d / "plan_other_model.json").write_text(json.dumps(other))
    moved = json.loads(json.dumps(good))
    moved["cluster"]["nodes"][0]["nic_bandwidth_bytes_per_s"] *= 2  # cluster edited after planning
    (d / "plan_other_cluster.json").write_text(json.dumps(moved))
    huge = json.loads(json.dumps(good))
    huge["predicted_peak_memory_bytes"] = {d: 2**45 for d in huge["predicted_peak_memory_bytes"]}
    (d / "plan_too_big.json").write_text(json.dumps(huge))
    (d / "profile_not_json.json").write_text("[1, 2")
    (d / "profile_kind.json").write_text(json.dumps({"kind": "heterog.Plan", "version": 1}))
    for name, text in USER_MODELS.items():
        (d / f"model_{name}.py").write_text(text)
    for name, text in DATA_FILES.items():
        (d / f"data_{name}.py").write_text(text)
    # A user-model plan whose model file then goes missing, and one whose file changes.
    for case in ("missing", "changed"):
        sub = d / case
        sub.mkdir()
        (sub / "net.py").write_text(
            textwrap.dedent("""\
            import torch
            from torch import nn
            def net():
                return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            def example_batch(batch_size):
                return (torch.randn(batch_size, 4),), torch.randint(0, 2, (batch_size,))
            """)
        )
        code = _invoke(
            [
                "plan",
                "--model",
                f"{sub}/net.py:net",
                "--batch-size",
                "4",
                "--cluster",
                "emulated-4",
                "--budget-s",
                "1",
                "--no-gnn",
                "--max-iters",
                "3",
                "--out",
                str(sub / "plan.json"),
            ]
        )
        assert code[0] == 0, code[1]
    (d / "missing" / "net.py").unlink()
    (d / "changed" / "net.py").write_text((d / "changed" / "net.py").read_text().replace("8", "16"))
    (d / "empty_ckpt").mkdir()
    return out


def _invoke(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in this process; return (exit code, stdout + stderr)."""
    runner = CliRunner()
    with runner.isolation() as (out, err, *_):
        try:
            code = run_cli(argv)
        except SystemExit as e:  # nothing should exit this way; record it if it does
            code = e.code if isinstance(e.code, int) else 1
        sys.stdout.flush()  # the text wrappers may still hold the last line (print's newline)
        sys.stderr.flush()
        text = out.getvalue().decode() + err.getvalue().decode()
    return code, text


def _cases(f: dict[str, Path]) -> dict[str, list[str]]:
    d, plan = f["dir"], str(f["plan"])
    cases = {
        # command-line options
        "batch_size_zero": ["plan", "--model", "mlp", "--batch-size", "0", "--cluster", "emulated-4"],
        "batch_size_text": ["plan", "--model", "mlp", "--batch-size", "eight", "--cluster", "emulated-4"],
        "missing_cluster": ["plan", "--model", "mlp", "--batch-size", "8"],
        "precision_fp8": ["plan", *PLAN_ARGS, "--precision", "fp8"],
        "optimizer_adam": ["plan", *PLAN_ARGS, "--optimizer", "adam"],
        "budget_negative": ["plan", *PLAN_ARGS, "--budget-s", "-1"],
        "seq_len_zero": ["plan", *PLAN_ARGS, "--seq-len", "0"],
        "unknown_option": ["plan", *PLAN_ARGS, "--fast"],
        "unknown_command": ["trian"],
        "unknown_model": ["plan", "--model", "resnet5", "--batch-size", "8", "--cluster", "emulated-4"],
        "model_arg_no_equals": ["plan", *PLAN_ARGS, "--model-arg", "hidden"],
        "model_arg_unknown": ["plan", *PLAN_ARGS, "--model-arg", "depth=3"],
        "unknown_cluster": ["plan", "--model", "mlp", "--batch-size", "8", "--cluster", "paper-9gpu"],
        "predict_unknown_gpu": ["predict", "--model", "mlp", "--batch-size", "8", "--device", "h900"],
        "predict_negative_batch": ["predict", "--model", "mlp", "--batch-size", "-3", "--device", "h100"],
        "run_missing_plan_arg": ["run"],
        "run_steps_zero": ["run", plan, "--steps", "0"],
        "run_timeout_zero": ["run", plan, "--timeout-s", "0"],
        "run_every_without_dir": ["run", plan, "--checkpoint-every", "2"],
        "run_dir_without_every": ["run", plan, "--checkpoint-dir", str(d / "ck")],
        "run_every_negative": ["run", plan, "--checkpoint-every", "-1", "--checkpoint-dir", str(d / "ck")],
        "run_resume_missing": ["run", plan, "--resume", str(d / "no_such_ckpt")],
        "run_resume_empty": ["run", plan, "--resume", str(d / "empty_ckpt")],
        "simulate_missing_file": ["simulate", str(d / "no_such_plan.json")],
        # plan files
        "plan_not_json": ["simulate", str(d / "not_json.json")],
        "plan_wrong_kind": ["run", str(d / "graph_kind.json")],
        "plan_wrong_version": ["run", str(d / "plan_v99.json")],
        "plan_no_groups": ["simulate", str(d / "plan_no_groups.json")],
        "plan_bad_shares": ["run", str(d / "plan_shares.json")],
        "plan_for_other_model": ["run", str(d / "plan_other_model.json")],
        "plan_for_other_cluster": ["run", str(d / "plan_other_cluster.json")],
        "plan_model_file_missing": ["run", str(d / "missing" / "plan.json")],
        "plan_model_file_changed": ["simulate", str(d / "changed" / "plan.json")],
        "plan_too_big_for_this_machine": ["run", str(d / "plan_too_big.json")],
        # profile files
        "profile_not_json": [
            "predict",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--device",
            "cpu",
            "--profile",
            str(d / "profile_not_json.json"),
        ],
        "profile_wrong_kind": [
            "predict",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--device",
            "cpu",
            "--profile",
            str(d / "profile_kind.json"),
        ],
        "profile_missing": [
            "predict",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--device",
            "cpu",
            "--profile",
            str(d / "no_profile.json"),
        ],
        # data loaders
        "data_no_colon": ["run", plan, "--data", str(d / "data_empty.py")],
        "data_missing_file": ["run", plan, "--data", f"{d}/no_data.py:loader"],
        "data_no_function": ["run", plan, "--data", f"{d}/data_empty.py:load"],
    }
    for name in BAD_CLUSTERS:
        cases[f"cluster_{name}"] = [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--cluster",
            str(d / f"cluster_{name}.yaml"),
        ]
    for name in USER_MODELS:
        cases[f"model_{name}"] = [
            "plan",
            "--model",
            f"{d}/model_{name}.py:net",
            "--batch-size",
            "4",
            "--cluster",
            "emulated-4",
        ]
    for name in DATA_FILES:
        cases[f"data_{name}"] = ["run", plan, "--data", f"{d}/data_{name}.py:loader"]
    return cases


USAGE = {
    "batch_size_zero",
    "batch_size_text",
    "missing_cluster",
    "precision_fp8",
    "optimizer_adam",
    "budget_negative",
    "seq_len_zero",
    "unknown_option",
    "unknown_command",
    "predict_negative_batch",
    "run_missing_plan_arg",
    "run_steps_zero",
    "run_timeout_zero",
    "run_every_negative",
}


def test_corpus_has_at_least_40_cases(files):
    assert len(_cases(files)) >= 40


def test_every_bad_invocation_fails_cleanly(files):
    failures = []
    for name, argv in _cases(files).items():
        code, text = _invoke(argv)
        lines = [line for line in text.splitlines() if line.strip()]
        problems = []
        if code == 0:
            problems.append("exit code 0")
        if name in USAGE and code != 2:
            problems.append(f"usage error exit code {code}, not 2")
        if "Traceback" in text or "internal error" in text:
            problems.append("traceback / internal error")
        if not 1 <= len(lines) < 10:
            problems.append(f"{len(lines)} lines")
        if name in USAGE and len([line for line in lines if line.startswith("error:")]) != 1:
            problems.append("not one 'error:' paragraph")
        if problems:
            failures.append(f"{name}: {', '.join(problems)}\n{text}")
    assert not failures, "\n\n".join(failures)


def test_messages_name_the_problem(files):
    expect = {
        "cluster_absurd_bandwidth": "implausible",
        "plan_for_other_model": "does not fit model",
        "plan_for_other_cluster": "different cluster",
        "plan_model_file_missing": "is missing",
        "plan_model_file_changed": "changed since the plan was made",
        "data_wrong_batch": "holds 5 samples but the plan's global batch is 8",
        "data_not_pairs": "expected a pair (inputs, targets)",
        "run_resume_empty": "holds no complete checkpoint",
        "optimizer_adam": "--optimizer",
        "plan_too_big_for_this_machine": "GiB is available",
    }
    cases = _cases(files)
    for name, needle in expect.items():
        code, text = _invoke(cases[name])
        assert needle in text, f"{name}: {text}"


def test_unusual_cluster_figure_warns_in_one_line(files):
    path = files["dir"] / "cluster_slow_nic.yaml"
    path.write_text(GOOD_CLUSTER.replace("nic_bandwidth_gbps: 10", "nic_bandwidth_gbps: 0.1"))
    code, text = _invoke(
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--cluster",
            str(path),
            "--budget-s",
            "1",
            "--no-gnn",
            "--max-iters",
            "2",
            "--json",
        ]
    )
    assert code == 0, text
    warnings = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "0.1 Gbit/s" in warnings[0] and "line 4" not in warnings[0], warnings


def test_version():
    code, text = _invoke(["--version"])
    from heterog import __version__

    assert code == 0 and text.strip() == f"heterog {__version__}"


@pytest.mark.parametrize(
    "argv, code",
    [
        (["plan", "--model", "mlp", "--batch-size", "0", "--cluster", "emulated-4"], 2),
        (["plan", "--model", "mlp", "--batch-size", "8", "--cluster", "no-such-cluster"], 2),
        (["--version"], 0),
    ],
)
def test_real_exit_codes(argv, code):
    r = subprocess.run([sys.executable, "-m", "heterog.cli.main", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr
