"""`heterog demo`: plan a model for an emulated cluster of unlike devices, run heterog's best
plan, the best baseline and even data parallelism on it — interleaved, several repetitions —
and compare predicted with measured iteration times; a speedup is claimed only if it holds
at the worst repetition.

The demo cluster has three local CPU processes on two emulated nodes joined by shaped
1 Gb/s links: two devices paced 3× and one paced 9×, so they differ 3× in speed. The fast
devices are paced too: pacing is on CPU time (emulation.py), so a device paced k× keeps
its declared speed while it gets at least 1/k of a core — three ranks then fit on a
2-core machine that others share, and the ratios between devices stay the declared ones.

Predictions use this machine's measured per-node times at one thread (profile/measure.py)
times each device's slowdown, so predicted and measured times describe the same hardware.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from heterog.pipeline import run
from heterog.hardware.cluster import Cluster
from heterog.ir.plan import ModelSpec, Plan

DEMO_CLUSTER_YAML = """
name: demo-3
kind: emulated
description: 3 local CPU processes on 2 emulated nodes; slowdowns 3/3/9; 1 Gb/s NICs
nodes:
  - name: fast
    nic_bandwidth_gbps: 1
    devices:
      - {type: cpu, name: fast/cpu0, slowdown: 3}
      - {type: cpu, name: fast/cpu1, slowdown: 3}
  - name: slow
    nic_bandwidth_gbps: 1
    devices:
      - {type: cpu, name: slow/cpu0, slowdown: 9}
"""
DEMO_MODEL = "toy-cnn"
DEMO_MODEL_ARGS = {"width": 64}   # convolutions dominate: 0.16 M parameters, ~1 GFLOP per sample
DEMO_BATCH_SIZE = 96


def demo_cluster() -> Cluster:
    from heterog.hardware.spec import parse_cluster_yaml
    return parse_cluster_yaml(DEMO_CLUSTER_YAML, "<demo cluster>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """Graph, cluster and cost model for planning and predicting on this machine."""
    graph: Any
    cluster: Cluster
    costs: Any
    spec: ModelSpec
    profiled: bool


def prepare(*, cluster: Cluster, model: str, model_args: dict[str, Any], batch_size: int,
            profile: bool = True, say: Callable[[str], None] = lambda s: None) -> Setup:
    """Capture the model and build costs as one rank sees this CPU (one thread)."""
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.execute.workload import resolve_workload
    from heterog.profile.measure import measure_profile

    torch.set_num_threads(1)  # every rank runs one thread; the cpu type is probed to match
    spec = ModelSpec(name=model, args=dict(model_args), batch_size=batch_size)
    graph = capture_model(model, model_args, batch_size=batch_size)
    prof = None
    if profile:
        say("measuring per-node times on this CPU (one thread)")
        # batch 1 catches the per-call overhead that dominates the small per-replica
        # micro-batches of pipelines; the cost model interpolates between the points.
        sizes = tuple(sorted({1, max(1, batch_size // 4), batch_size}))
        prof = measure_profile(resolve_workload(spec), batch_sizes=sizes, graph=graph, repeats=9)
    costs = build_cost_model(graph, cluster, profile=prof)
    return Setup(graph=graph, cluster=cluster, costs=costs, spec=spec, profiled=prof is not None)


def predict(setup: Setup, plan: Plan) -> float:
    from heterog.simulate.simulator import simulate
    return float(simulate(setup.graph, setup.cluster, plan, setup.costs, timeline=False).iteration_time_s)


def runnable(setup: Setup, plan: Plan) -> Plan:
    """A candidate plan made self-contained: the cluster spec and the model it was made for."""
    from heterog.hardware.spec import cluster_to_dict
    return dataclasses.replace(plan, model=setup.spec, cluster=cluster_to_dict(setup.cluster),
                               cluster_fingerprint=setup.cluster.fingerprint())


def measure(setup: Setup, plan: Plan, *, steps: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run `plan` and return its predicted and measured iteration times."""
    out = run(runnable(setup, plan), steps=steps, predict=False, timeout_s=timeout_s)
    predicted = predict(setup, plan)
    measured = out["measured_iteration_time_s"]
    return {"predicted_iteration_time_s": predicted, "measured_iteration_time_s": measured,
            "relative_error": (measured - predicted) / predicted, "link_shaping": out["link_shaping"],
            "per_rank": out["per_rank"], "notes": out["notes"]}


def best_baseline(result) -> Any:
    """The baseline the simulator ranks fastest among the feasible ones."""
    from heterog.search.baselines import BASELINE_BUILDERS
    feasible = [c for c in result.candidates if c.strategy in BASELINE_BUILDERS and c.feasible]
    return min(feasible, key=lambda c: c.iteration_time_s)


def interleaved(setup: Setup, plans: dict[str, Plan], *, steps: int, repetitions: int,
                say: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Measure every strategy `repetitions` times, interleaved (A B C A B C …), so a slow spell
    of a shared machine hits all of them alike; per strategy the median, the spread and the
    repetitions themselves."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in plans}
    for rep in range(repetitions):
        for label, plan in plans.items():
            say(f"repetition {rep + 1}/{repetitions}: {label} ({plan.strategy}), {steps} steps")
            runs[label].append(measure(setup, plan, steps=steps))
    out = {}
    for label, rs in runs.items():
        times = [r["measured_iteration_time_s"] for r in rs]
        median = statistics.median(times)
        predicted = rs[0]["predicted_iteration_time_s"]
        out[label] = {"strategy": plans[label].strategy, "predicted_iteration_time_s": predicted,
                      "measured_iteration_time_s": median, "repetitions_s": times,
                      "spread": max(times) / min(times) - 1.0,
                      "relative_error": (median - predicted) / predicted,
                      "link_shaping": rs[0]["link_shaping"], "per_rank": rs[-1]["per_rank"], "notes": rs[0]["notes"]}
    return out


def speedup(strategies: dict[str, dict[str, Any]], base: str) -> dict[str, Any]:
    """heterog's speedup over `base`: the median of the per-repetition ratios, and the worst
    repetition's; it is claimed only if it holds there (`holds`)."""
    ratios = [b / h for b, h in zip(strategies[base]["repetitions_s"], strategies["heterog"]["repetitions_s"])]
    return {"median": statistics.median(ratios), "worst": min(ratios), "best": max(ratios),
            "holds": min(ratios) > 1.0,
            "predicted": strategies[base]["predicted_iteration_time_s"]
            / strategies["heterog"]["predicted_iteration_time_s"]}


def demo(*, steps: int = 8, budget_s: float = 5.0, profile: bool = True, repetitions: int = 3,
         say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Plan the demo model, then run heterog's plan, the best baseline and even data
    parallelism `repetitions` times each, interleaved."""
    from heterog.search.planner import plan_graph

    t0 = time.perf_counter()
    cluster = demo_cluster()
    say(f"capturing {DEMO_MODEL} {DEMO_MODEL_ARGS} at batch {DEMO_BATCH_SIZE}")
    setup = prepare(cluster=cluster, model=DEMO_MODEL, model_args=DEMO_MODEL_ARGS,
                    batch_size=DEMO_BATCH_SIZE, profile=profile, say=say)
    say(f"planning for {cluster.name} (budget {budget_s:g} s)")
    result = plan_graph(setup.graph, cluster, setup.costs, budget_s=budget_s, model_spec=setup.spec)
    even = next(c.plan for c in result.candidates if c.strategy == "even-dp-allreduce")
    plans = {"heterog": result.best, "best-baseline": best_baseline(result).plan, "even-dp": even}
    strategies = interleaved(setup, plans, steps=steps, repetitions=repetitions, say=say)
    vs_even, vs_best = speedup(strategies, "even-dp"), speedup(strategies, "best-baseline")
    return {"cluster": cluster.name, "model": DEMO_MODEL, "model_args": DEMO_MODEL_ARGS,
            "batch_size": DEMO_BATCH_SIZE, "profiled": setup.profiled, "repetitions": repetitions,
            "candidates": [c.to_dict() for c in result.candidates],
            "strategies": strategies,
            "measured_speedup": vs_even["median"], "predicted_speedup": vs_even["predicted"],
            "speedup_vs_even_dp": vs_even,
            "measured_speedup_vs_best_baseline": vs_best["median"], "speedup_vs_best_baseline": vs_best,
            "best_plan_notes": list(result.best.notes), "demo_time_s": time.perf_counter() - t0}
