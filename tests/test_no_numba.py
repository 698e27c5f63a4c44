"""heterog where numba (and torch_geometric) cannot be imported: the simulator's loops run as
plain Python with the same results, and the executor path imports neither.

The absent packages are made absent in every process a test starts (the rank processes
too) by a sitecustomize.py on PYTHONPATH whose import hook refuses them, as on a machine
where they are not installed; nothing is uninstalled."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

from heterog import _jit

TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"
ABSENT = ("numba", "torch_geometric")
NOTICE = "heterog's simulator runs as plain Python"

SITECUSTOMIZE = f'''
import sys

class _Absent:
    """Refuse these packages, as if they were not installed."""
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Absent())
'''


def _python_without(
    tmp_path: Path, code: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (and its children) where numba and torch_geometric
    cannot be imported."""
    site = tmp_path / "absent_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True, timeout=timeout_s
    )


def test_the_command_line_loads_without_numba_and_torch_geometric(tmp_path):
    code = (
        "import sys\n"
        f"for name in {ABSENT!r}:\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        sys.exit(f'{name} is importable: the hook does not work')\n"
        "import heterog.cli.main\n"
        "from heterog.cli.main import run_cli\n"
        "assert run_cli(['check', '--help']) == 0\n"
        "sys.exit(run_cli(['run', '--help']))\n"
    )
    out = _python_without(tmp_path, code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Usage: heterog run" in out.stdout and "--steps" in out.stdout, out.stdout
    assert "Usage: heterog check" in out.stdout and "--device" in out.stdout, out.stdout


def test_the_executor_side_does_not_load_numba_or_torch_geometric():
    """Where both are installed: the command line and a rank process import neither, nor scipy
    (a rank interprets its Program, it never schedules or simulates), so a GPU machine's ranks
    need none of their wheels."""
    code = (
        "import sys, contextlib, io\n"
        "from heterog.cli.main import run_cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert run_cli(['run', '--help']) == 0\n"
        "import heterog.execute.worker\n"
        f"print(sorted(m for m in {ABSENT + ('scipy', 'heterog._jit')!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def simulated(cases: list[tuple[str, str]]) -> dict:
    """Per (cluster, plan) of benchmarks/simulator_speed.py: the execution order, every task's
    start and end, the peaks, first overflow and memory timelines (engine.run), and the whole
    SimResult as the search and the CLI read it."""
    spec = importlib.util.spec_from_file_location("simulator_speed", BENCHMARKS / "simulator_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.lower.schedule import build_schedule
    from heterog.simulate import engine, simulate

    out = {}
    for cname in dict.fromkeys(c for c, _ in cases):
        cluster = load_cluster(cname)
        graph = bench.synthetic_graph(batch_size=max(64, 4 * len(cluster.devices)))
        costs = build_cost_model(graph, cluster)
        plans = bench.make_plans(graph, cluster, random.Random(0))
        for c, pname in cases:
            if c != cname:
                continue
            sched = build_schedule(graph, cluster, plans[pname], costs)
            timed = engine.run(sched.tasks, sched.order, sched.info, True)
            r = simulate(graph, cluster, plans[pname], costs, timeline=True)
            out[cname, pname] = {
                "order": sched.order.tolist(),
                "timed": timed,
                "result": r.to_dict(),
                "memory_timeline": r.memory_timeline,
            }
    return out


# the benchmark's three plan shapes on its smallest cluster, and its 1F1B pipeline on 64 devices
CASES = [("paper-8gpu", "dp"), ("paper-8gpu", "pipe-dp"), ("paper-8gpu", "hybrid"), ("mixed-64", "pipe-dp")]


def test_uncompiled_simulator_equals_compiled_on_the_benchmark_plans(tmp_path):
    assert _jit.COMPILED, f"this test compares with numba's results, but {_jit.WHY_UNCOMPILED}"
    dump = tmp_path / "uncompiled.pkl"
    code = (
        f"import pickle, sys; sys.path.insert(0, {str(TESTS)!r})\n"
        "from heterog import _jit\n"
        "assert not _jit.COMPILED and 'numba cannot be imported' in _jit.WHY_UNCOMPILED, _jit.WHY_UNCOMPILED\n"
        "from test_no_numba import CASES, simulated\n"
        "pickle.dump(simulated(CASES), open(sys.argv[1], 'wb'))\n"
    )
    out = _python_without(tmp_path, code, str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(NOTICE) == 1, out.stderr
    uncompiled = pickle.loads(dump.read_bytes())
    compiled = simulated(CASES)
    assert list(uncompiled) == CASES
    for case in CASES:
        for part in ("order", "timed", "result", "memory_timeline"):
            assert uncompiled[case][part] == compiled[case][part], f"{case}: {part} differs without numba"


TWO_CPUS = """
name: two-cpus
kind: emulated
nodes:
  - name: n0
    nic_bandwidth_gbps: 10
    devices:
      - {type: cpu, name: n0/cpu0}
      - {type: cpu, name: n0/cpu1, slowdown: 2}
"""


@pytest.mark.slow
def test_plan_lower_simulate_run_without_numba_and_torch_geometric(tmp_path):
    """The whole chain, uncompiled (HETEROG_NO_NUMBA=1), in processes that cannot import numba
    or torch_geometric: a tiny model planned (without the GNN), lowered, simulated and run
    for 2 steps on 2 emulated ranks, in one process that says once that it runs uncompiled;
    the simulation equals a compiled one of the same plan. One torch thread in both, so that
    the measured `cpu` device type is the same (lowering for a run sets one thread)."""
    (tmp_path / "cluster.yaml").write_text(TWO_CPUS)
    plan = tmp_path / "plan.json"
    chain = [
        [
            "plan",
            "--model",
            "mlp",
            "--batch-size",
            "8",
            "--cluster",
            str(tmp_path / "cluster.yaml"),
            "--no-gnn",
            "--budget-s",
            "5",
            "--max-iters",
            "20",
            "--strategy",
            "even-dp-allreduce",
            "--json",
            "--out",
            str(plan),
        ],
        ["lower", str(plan), "--json", "--out", str(tmp_path / "program.json")],
        ["simulate", str(plan), "--json"],
        ["run", str(plan), "--steps", "2", "--json", "--out", str(tmp_path / "run.json")],
    ]
    code = (
        "import contextlib, sys\n"
        "from heterog.cli.main import run_cli\n"
        f"for argv in {chain!r}:\n"
        f"    with open({str(tmp_path)!r} + '/' + argv[0] + '.out', 'w') as f, contextlib.redirect_stdout(f):\n"
        "        code = run_cli(argv)\n"
        "    if code:\n"
        "        sys.exit(f'heterog {argv[0]} exited with {code}')\n"
    )
    one_thread = {"OMP_NUM_THREADS": "1"}
    out = _python_without(tmp_path, code, env={"HETEROG_NO_NUMBA": "1", **one_thread}, timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(NOTICE) == 1 and "HETEROG_NO_NUMBA is set" in out.stderr, out.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert [r["device"] for r in result["per_rank"]] == ["n0/cpu0", "n0/cpu1"]
    assert result["measured_steps"] == 1 and result["losses"][0] > 0  # 2 steps, the first a warm-up
    assert result["prediction_source"] == "simulator" and result["predicted_iteration_time_s"] > 0

    compiled = subprocess.run(
        [sys.executable, "-m", "heterog.cli.main", "simulate", str(plan), "--json"],
        env={**os.environ, **one_thread},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compiled.returncode == 0 and NOTICE not in compiled.stderr, compiled.stderr[-3000:]
    assert json.loads((tmp_path / "simulate.out").read_text()) == json.loads(compiled.stdout)
