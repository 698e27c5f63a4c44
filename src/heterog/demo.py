"""`heterog demo`: plan a model for an emulated cluster of unlike devices, run heterog's best
plan, the best baseline and even data parallelism on it — interleaved, several repetitions —
and compare predicted with measured iteration times; a speedup is claimed only if it holds
at the worst repetition.

The demo runs one of the SCENARIOS below (DEMO_SCENARIO): three local CPU processes on two
emulated nodes joined by tc-shaped links, unlike in speed (paced 3× and 6×), with one node
behind a slow link and, in some scenarios, a device whose memory is capped. Every device is
paced: pacing is on CPU time (emulation.py), so a device paced k× keeps
its declared speed while it gets at least 1/k of a core — three ranks then fit on a
2-core machine that others share, and the ratios between devices stay the declared ones.

Predictions use this machine's measured per-node times at one thread (profile/measure.py)
times each device's slowdown, so predicted and measured times describe the same hardware;
each is the simulation of the schedule its run carries out (heterog.runs: one lowering).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

from heterog.cost.profile import LinkCalibratedCosts
from heterog.errors import HeterogWarning
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_to_dict, parse_cluster_yaml
from heterog.inputs import PlanInputs, model_inputs
from heterog.ir.plan import ModelSpec, Plan
from heterog.ir.run_request import Limits, RunOptions, TimingConfig
from heterog.ir.run_result import RankSummary, RunResult
from heterog.lower.tensor_parallel import executor_tensor_parallel
from heterog.plan_module import model_graph, search
from heterog.profile.links import LinkMeasurementError, calibrate_links
from heterog.profile.measure import measured_profile
from heterog.report.tables import segments
from heterog.runs import run, run_interleaved
from heterog.search.baselines import BASELINE_BUILDERS

# One emulated cluster shape, varied in speed, links and memory: node a has two devices,
# node b one behind its own (slow) NIC. Pacing every device at least 3× keeps three ranks at
# their declared speeds on a shared 2-core machine (see above).
_CLUSTER = """
name: {name}
kind: emulated
description: {description}
nodes:
  - name: a
    nic_bandwidth_gbps: 1
    devices:
      - {{type: cpu, name: a/cpu0, slowdown: {s0}{cap0}}}
      - {{type: cpu, name: a/cpu1, slowdown: {s1}{cap1}}}
  - name: b
    nic_bandwidth_gbps: {slow_gbps}
    devices:
      - {{type: cpu, name: b/cpu0, slowdown: {s2}{cap2}}}
"""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """A model on an emulated cluster where placement matters, not only speed: one node
    behind a slow link, and optionally a device with little memory (enforced at run time)."""

    name: str
    family: str  # 'cnn' or 'transformer-lm'
    model: str
    model_args: dict[str, Any]
    batch_size: int
    seq_len: int | None = None
    slow_link_gbps: float = 0.2  # node b's NIC
    memory_gib: float | None = None  # the capped device's emulated memory (None: the machine's)
    capped_device: str = "b/cpu0"  # or "*": every device
    slowdowns: tuple[float, float, float] = (3.0, 6.0, 3.0)  # a/cpu0, a/cpu1, b/cpu0
    optimizer: str = "sgd"

    @property
    def capped_devices(self) -> tuple[str, ...]:
        if not self.memory_gib:
            return ()
        return ("a/cpu0", "a/cpu1", "b/cpu0") if self.capped_device == "*" else (self.capped_device,)

    @property
    def description(self) -> str:
        who = "every device" if self.capped_device == "*" else self.capped_device
        cap = f"; {who} holds {self.memory_gib:g} GiB" if self.memory_gib else ""
        s0, s1, s2 = self.slowdowns
        return (
            f"3 local CPU processes on 2 emulated nodes; slowdowns {s0:g}/{s1:g} and {s2:g}; node b "
            f"behind a {self.slow_link_gbps:g} Gb/s link{cap}"
        )

    def cluster(self) -> Cluster:
        """The scenario's cluster (its slow link and small memory are deliberate: the
        plausibility warnings about them are silenced)."""
        yaml = _CLUSTER.format(
            name=f"{self.name}-3",
            description=self.description,
            slow_gbps=self.slow_link_gbps,
            s0=self.slowdowns[0],
            s1=self.slowdowns[1],
            s2=self.slowdowns[2],
            **{
                f"cap{i}": f", memory_gib: {self.memory_gib}" if name in self.capped_devices else ""
                for i, name in enumerate(("a/cpu0", "a/cpu1", "b/cpu0"))
            },
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_cluster_yaml(yaml, f"<scenario {self.name}>")


# The CNN's classifier holds most parameters (toy-cnn's fc: 128·8·8 × classes), the
# convolutions most compute; the LM's tied embedding / head holds most parameters. Gradients
# of the classifier or embedding through node b's slow link are what even and
# speed-proportional data parallelism pay for; placing them is what heterog can change.
_GPT2_SMALL = {"hidden": 128, "layers": 2, "heads": 4, "vocab": 32768, "positions": 64, "dropout": 0.0}
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="cnn-slow-link",
            family="cnn",
            model="toy-cnn",
            model_args={"width": 32, "num_classes": 1000},
            batch_size=96,
            slowdowns=(3.0, 3.0, 6.0),
        ),
        Scenario(
            name="cnn-small-memory",
            family="cnn",
            model="toy-cnn",
            model_args={"width": 32, "num_classes": 2000},
            batch_size=96,
            slowdowns=(3.0, 3.0, 6.0),
            memory_gib=0.0625,
        ),
        # A Llama with an untied 32k vocabulary trained with AdamW, every device holding
        # 88 MiB: the state (~131 MB) fits no device whole, nor does the head's stage with its
        # logits; sharding the state is the way in (lower/shard_tasks.py).
        Scenario(
            name="lm-sharded-memory",
            family="transformer-lm",
            model="llama",
            model_args={"hidden": 128, "layers": 2, "heads": 4, "ffn": 256, "vocab": 32000, "positions": 64},
            batch_size=16,
            seq_len=32,
            slow_link_gbps=0.5,
            slowdowns=(3.0, 3.0, 6.0),
            memory_gib=0.0859375,
            capped_device="*",
            optimizer="adamw",
        ),
        Scenario(
            name="lm-slow-link",
            family="transformer-lm",
            model="gpt2",
            model_args=_GPT2_SMALL,
            batch_size=16,
            seq_len=32,
        ),
        Scenario(
            name="lm-small-memory",
            family="transformer-lm",
            model="gpt2",
            model_args=_GPT2_SMALL,
            batch_size=16,
            seq_len=32,
            memory_gib=0.0625,
        ),
        # The fastest device sits behind the slow link: every single-device baseline picks it,
        # every data-parallel one pays the tied embedding's gradients through its link.
        # Paced 6× and more, so the pacing absorbs a shared machine's contention (emulation.py).
        Scenario(
            name="lm-fast-far",
            family="transformer-lm",
            model="gpt2",
            model_args=_GPT2_SMALL,
            batch_size=16,
            seq_len=32,
            slowdowns=(8.0, 8.0, 6.0),
        ),
        # cnn-slow-link's cluster for the LM: two like devices on node a, the slowest behind the
        # slow link. lm-slow-link's a/cpu1 (6×) caps data parallelism over node a at 1.5× one
        # device; here it may reach 2×.
        Scenario(
            name="lm-slow-far",
            family="transformer-lm",
            model="gpt2",
            model_args=_GPT2_SMALL,
            batch_size=16,
            seq_len=32,
            slowdowns=(3.0, 3.0, 6.0),
        ),
    )
}
DEMO_SCENARIO = "cnn-slow-link"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """Graph, cluster and cost model for planning and predicting on this machine."""

    graph: Any
    cluster: Cluster
    costs: Any
    spec: ModelSpec
    profiled: bool
    links: tuple[dict[str, Any], ...] = ()  # the shaped links as measured (profile/links.py)

    @property
    def inputs(self) -> PlanInputs:
        return PlanInputs(self.graph, self.cluster, self.costs)


def prepare(
    *,
    cluster: Cluster,
    model: str,
    model_args: dict[str, Any],
    batch_size: int,
    seq_len: int | None = None,
    profile: bool = True,
    links: bool = True,
    optimizer: str = "sgd",
    say: Callable[[str], None] = lambda s: None,
) -> Setup:
    """Capture the model and build costs as one rank sees this CPU (one thread): the same
    steps as heterog.plan (plan_module.py). With `profile`, per-node times are measured here;
    with `links` too (as root, on an emulated cluster of several nodes), each shaped link is
    measured once and the cost model's transfers and collectives use what it carried
    (cost.profile.LinkCalibratedCosts)."""
    spec, graph = model_graph(model, model_args=model_args, batch_size=batch_size, seq_len=seq_len)
    prof = None
    if profile:
        say("measuring per-node times on this CPU (one thread)")
        # batch 1 catches the per-call overhead that dominates the small per-replica
        # micro-batches of pipelines; the cost model interpolates between the points.
        prof = measured_profile(spec, graph, repeats=9)
    # the inputs heterog plan / simulate / run build (heterog/inputs.py), with this profile
    graph, cluster, costs = model_inputs(spec, cluster, profile=prof, graph=graph, optimizer=optimizer)
    measured: tuple[dict[str, Any], ...] = ()
    if profile and links:
        costs, measured = _calibrated_links(costs, cluster, say)
    return Setup(graph=graph, cluster=cluster, costs=costs, spec=spec, profiled=prof is not None, links=measured)


def _calibrated_links(costs: Any, cluster: Cluster, say: Callable[[str], None]) -> tuple[Any, tuple]:
    """Costs whose communication uses the emulated cluster's links as measured — the
    intra-node loopback always, the shaped NICs as root — and the measurements; the costs
    unchanged on a cluster that is not emulated."""
    if cluster.kind != "emulated":
        return costs, ()
    try:
        pairs = calibrate_links(cluster, nics=os.geteuid() == 0, say=say)
    except LinkMeasurementError as e:
        say(f"links not calibrated ({e})")
        return costs, ()
    if not pairs:
        return costs, ()
    return (
        LinkCalibratedCosts(costs, cluster, tuple(c for c, _ in pairs)),
        tuple({**m.to_dict(), "node": c.node, "scope": str(c.scope)} for c, m in pairs),
    )


def runnable(setup: Setup, plan: Plan) -> Plan:
    """A candidate plan made self-contained: the cluster spec and the model it was made for."""
    return dataclasses.replace(
        plan, model=setup.spec, cluster=cluster_to_dict(setup.cluster), cluster_fingerprint=setup.cluster.fingerprint()
    )


def measure(setup: Setup, plan: Plan, *, steps: int, timeout_s: float = 120.0) -> RunResult:
    """Run `plan` once: its measurement beside the prediction of the same schedule."""
    with warnings.catch_warnings():  # the scenario's deliberate slow link / small memory, again
        warnings.simplefilter("ignore", HeterogWarning)
        return run(
            runnable(setup, plan), RunOptions(steps=steps, limits=Limits(timeout_s=timeout_s)), inputs=setup.inputs
        )


def placement(plan: Plan) -> dict[str, Any]:
    """What a plan is, in a few lines of JSON: its runs of groups with one placement (the
    report's placement table: shares, sync, parameter server), micro-batches and schedule."""
    return {
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "segments": [dataclasses.asdict(s) for s in segments(plan)],
    }


def contention(per_rank: tuple[RankSummary, ...]) -> float:
    """How much slower than declared the slowest-running emulated device computed, because
    the shared machine did not give its rank the CPU: pacing (emulation.py) stretches
    compute to slowdown × CPU time, so compute wall time beyond that is contention the pacing
    could not absorb (0: every device ran at its declared speed). The largest over ranks."""
    worst = 0.0
    for r in per_rank:
        target = r.slowdown * r.cpu_s
        if target > 0 and r.slowdown > 1.0:
            worst = max(worst, r.compute_s / target - 1.0)
    return max(worst, 0.0)


def best_baseline(result) -> Any:
    """The baseline the simulator ranks fastest among the feasible ones."""
    feasible = [c for c in result.candidates if c.strategy in BASELINE_BUILDERS and c.feasible]
    return min(feasible, key=lambda c: c.iteration_time_s)


def interleaved(
    setup: Setup,
    plans: dict[str, Plan],
    *,
    steps: int,
    repetitions: int,
    say: Callable[[str], None],
    failed: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Measure every strategy `repetitions` times, interleaved (A B C, C B A, …) in one launch
    (heterog.run_interleaved), so a slow spell of a shared machine hits all of them alike and
    consecutive strategies run seconds apart; per strategy the median, the spread and the
    repetitions themselves, beside the prediction of the schedule that ran. With `failed`
    given, a plan whose run fails is recorded there (label → the error) and left out;
    otherwise the error propagates."""
    labels = list(plans)
    say(
        f"{repetitions} repetitions of {', '.join(f'{k} ({plans[k].strategy})' for k in labels)}, "
        f"{steps} steps each, interleaved in one launch"
    )
    options = RunOptions(steps=steps, timing=TimingConfig(repetitions=repetitions), limits=Limits(timeout_s=120.0))
    with warnings.catch_warnings():  # the scenario's deliberate slow link / small memory, again
        warnings.simplefilter("ignore", HeterogWarning)
        got = run_interleaved([runnable(setup, plans[k]) for k in labels], options, inputs=setup.inputs)
    out = {}
    for label, result in zip(labels, got):
        if not result.ok:
            assert result.failure is not None
            if failed is None:
                result.raise_for_failure()
            else:
                failed[label] = result.failure.message.split(" Log tail:")[0]
            continue
        out[label] = {
            "strategy": plans[label].strategy,
            "predicted_iteration_time_s": result.predicted_iteration_time_s,
            "measured_iteration_time_s": result.measured_iteration_time_s,
            "repetitions_s": list(result.repetitions_s),
            "contention": statistics.median(contention(rep.per_rank) for rep in result.repetitions),
            "spread": result.spread,
            "relative_error": result.relative_error,
            "link_shaping": result.link_shaping.to_dict(),
            "per_rank": [r.to_dict() for r in result.per_rank],
            "by_kind": [k.to_dict() for k in result.by_kind()],
            "notes": list(result.notes),
            "placement": placement(plans[label]),
        }
    return out


def speedup(strategies: dict[str, dict[str, Any]], base: str, top: str = "heterog") -> dict[str, Any]:
    """The speedup of `top` (heterog's plan) over `base`: the median of the per-repetition
    ratios (repetitions ran interleaved, so each ratio compares runs made side by side), and
    the worst repetition's; it is claimed only if it holds there (`holds`)."""
    ratios = [b / h for b, h in zip(strategies[base]["repetitions_s"], strategies[top]["repetitions_s"])]
    return {
        "median": statistics.median(ratios),
        "worst": min(ratios),
        "best": max(ratios),
        "holds": min(ratios) > 1.0,
        "predicted": strategies[base]["predicted_iteration_time_s"] / strategies[top]["predicted_iteration_time_s"],
    }


def demo(
    *,
    steps: int = 8,
    budget_s: float = 5.0,
    profile: bool = True,
    repetitions: int = 5,
    scenario: str = DEMO_SCENARIO,
    say: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Plan the scenario's model, then run heterog's plan, the best baseline and even data
    parallelism `repetitions` times each, interleaved. Even data parallelism that the
    planner finds does not fit a device's memory is left out (its speedup is None)."""
    t0 = time.perf_counter()
    sc = SCENARIOS[scenario]
    cluster = sc.cluster()
    say(f"capturing {sc.model} {sc.model_args} at batch {sc.batch_size}")
    setup = prepare(
        cluster=cluster,
        model=sc.model,
        model_args=sc.model_args,
        batch_size=sc.batch_size,
        seq_len=sc.seq_len,
        profile=profile,
        optimizer=sc.optimizer,
        say=say,
    )
    say(f"planning for {cluster.name}: {sc.description} (budget {budget_s:g} s)")
    # the plans are run: none may split groups the executor cannot split yet
    tp = executor_tensor_parallel()
    result = search(setup.inputs, setup.spec, budget_s=budget_s, optimizer=sc.optimizer, tensor_parallel=tp)
    even = next(c for c in result.candidates if c.strategy == "even-dp-allreduce")
    plans = {"heterog": result.best, "best-baseline": best_baseline(result).plan}
    if even.feasible:
        plans["even-dp"] = even.plan
    strategies = interleaved(setup, plans, steps=steps, repetitions=repetitions, say=say)
    vs_even = speedup(strategies, "even-dp") if even.feasible else None
    vs_best = speedup(strategies, "best-baseline")
    return {
        "scenario": sc.name,
        "description": sc.description,
        "cluster": cluster.name,
        "model": sc.model,
        "model_args": sc.model_args,
        "batch_size": sc.batch_size,
        "seq_len": sc.seq_len,
        "profiled": setup.profiled,
        "links_measured": list(setup.links),
        "repetitions": repetitions,
        "candidates": [c.to_dict() for c in result.candidates],
        "strategies": strategies,
        "measured_speedup": vs_even["median"] if vs_even else None,
        "predicted_speedup": vs_even["predicted"] if vs_even else None,
        "speedup_vs_even_dp": vs_even,
        "measured_speedup_vs_best_baseline": vs_best["median"],
        "speedup_vs_best_baseline": vs_best,
        "best_plan_notes": list(result.best.notes),
        "demo_time_s": time.perf_counter() - t0,
    }
