"""Orchestration: a plan's inputs, its Program, its simulation and its check, in one place for
the CLI and the Python API (the runs themselves: heterog/runs/).

Stages import only downward; this module is the one that calls them in sequence. Every
function that takes a plan takes anything `inputs.as_plan` accepts (a Plan, a plan dict such
as a plan result's "best", a plan result, a Program, or a plan / program / `plan --json` file),
and builds the plan's graph, cluster and costs with `inputs.plan_inputs`, as `heterog plan`
does, so that they all predict the same time:
- `lower(plan)` → Program: the per-device instructions (heterog.lower);
- `simulate(plan)` → SimResult: the simulator's prediction (also `simulate(graph, cluster,
  plan, costs)`, the simulator itself);
- `check(plan)` → CheckResult: every rank's stages built and run without communication;
- `lowered(plan, cluster)` → Lowered: what a run carries out and predicts, from one schedule:
  the Program and, on request, the simulation of that very schedule, whose events name the
  Program's instructions (lower/program.py instruction_id).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from heterog.cost.analytic import AnalyticCostModel
from heterog.cost.tensor_parallel import megatron_layout
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_from_dict
from heterog.inputs import PlanInputs, as_plan
from heterog.inputs import plan_inputs as _inputs_of_plan
from heterog.ir.plan import Plan
from heterog.lower.lowering import program_devices, to_program
from heterog.lower.program import Program, validate
from heterog.lower.schedule import build_schedule, cover_graph
from heterog.lower.tensor_parallel import member_program, op_stride, runnable
from heterog.simulate.result import SimResult
from heterog.simulate.simulator import simulate as simulate_schedule
from heterog.simulate.simulator import time_schedule
from heterog.simulate.tensor_parallel import collective_events, mirror_members, tensor_parallel_inputs


def plan_cluster(plan: Plan) -> Cluster | None:
    if not plan.cluster:
        return None
    return cluster_from_dict(plan.cluster)


def local_cpu_cluster(plan: Plan) -> Cluster:
    """For a plan that records no cluster (written by hand): its devices as equal CPU ranks on
    one emulated node, which is what the local launcher runs them as."""
    names = rank_devices(plan, None)
    return cluster_from_dict(
        {
            "name": "local-cpu",
            "kind": "emulated",
            "nodes": [
                {"name": "local", "nic_bandwidth_gbps": 10, "devices": [{"type": "cpu", "name": d} for d in names]}
            ],
        }
    )


def cluster_of(plan: Plan) -> Cluster:
    """The cluster a plan records, or its devices as local CPU ranks when it records none."""
    return plan_cluster(plan) or local_cpu_cluster(plan)


def rank_devices(plan: Plan, cluster: Cluster | None) -> tuple[str, ...]:
    """Rank → device: the plan's devices (and parameter servers) in the cluster's order."""
    if cluster is None:
        return tuple(dict.fromkeys([*plan.devices(), *(g.ps_device for g in plan.groups if g.ps_device)]))
    return program_devices(plan, cluster)


def read_plan(path: str | os.PathLike) -> Plan:
    """A Plan from a plan file, the plan a Program file was lowered from, or the best plan of
    `heterog plan --json` output."""
    return as_plan(path)


def plan_inputs(plan: Plan, cluster: Cluster, *, profile: bool = False, graph=None) -> PlanInputs:
    """(graph, cluster as its ranks see it, cost model) for `plan` on `cluster`, built as
    `heterog plan` builds them (inputs.plan_inputs). profile: per-node times measured on this
    CPU first (one thread, as the ranks run; a few seconds), for emulated clusters."""
    prof = None
    if profile:
        # torch loads only to measure: `heterog lower`/`simulate` start without it
        from heterog.profile.measure import measured_profile

        if graph is None:
            graph = _inputs_of_plan(plan, cluster=cluster).graph
        prof = measured_profile(plan.model, graph)
    return _inputs_of_plan(plan, cluster=cluster, graph=graph, profile=prof)


def lower(plan: Any) -> Program:
    """The Program of a plan (anything inputs.as_plan takes): every device's instructions,
    validated."""
    plan = as_plan(plan)
    return lowered(plan, cluster_of(plan), predict=False).program


def simulate(plan: Any, *simulator_args: Any, **options: Any) -> SimResult:
    """The simulator's prediction of one iteration of `plan` (anything inputs.as_plan takes) on
    the cluster it records, from the inputs `heterog plan` used: the time it predicted.

    simulate(graph, cluster, plan, costs, timeline=…, cache=…), with the inputs given, is the
    simulator itself (heterog.simulate.simulator.simulate)."""
    if simulator_args or "costs" in options:
        return simulate_schedule(plan, *simulator_args, **options)
    plan = as_plan(plan)
    graph, seen, costs = plan_inputs(plan, cluster_of(plan))
    return simulate_schedule(graph, seen, cover_graph(plan, graph), costs, **options)


def check(plan: Plan | str | os.PathLike, *, device: str = "meta", cache=None):
    """heterog check: lower the plan, then build every rank's stages for `device` and run
    their compute without communication (execute/check.py); a CheckResult."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.check import check_program

    if not isinstance(plan, Plan):
        plan = read_plan(plan)
    return check_program(plan, lower(plan), device=device, cache=cache)


@dataclass(frozen=True, kw_only=True)
class Lowered:
    """A plan made ready to run: its Program, and the simulation of the schedule the Program
    was written from (None when no prediction was asked)."""

    plan: Plan  # as given
    covered: Plan  # as lowered (every node of the graph in a group)
    inputs: PlanInputs  # graph, cluster as the ranks see it, costs
    program: Program
    sim: SimResult | None

    @property
    def predicted_iteration_time_s(self) -> float | None:
        return float(self.sim.iteration_time_s) if self.sim is not None else None


def lowered(
    plan: Plan,
    cluster: Cluster,
    *,
    predict: bool = True,
    profile: bool = False,
    graph=None,
    inputs: PlanInputs | None = None,
) -> Lowered:
    """Lower `plan` on `cluster` with the costs of this machine's ranks (inputs.device_view)
    and, with `predict`, time the same schedule: one schedule (unmerged, every device its
    own tasks), so that the run carries out what is predicted and each Program instruction
    has its simulated start and end. graph: the model's capture, when the caller has it;
    inputs: the (graph, cluster, costs) the caller predicts with (a profiled cost model)."""
    runnable(plan, "lowering to a Program (heterog lower, check, run)")
    if plan.tensor_parallel and (profile or (inputs is not None and type(inputs[2]) is not AnalyticCostModel)):
        profile, inputs = False, None  # priced by the analytic model of its slices (simulate/tensor_parallel.py)
    got = inputs if inputs is not None else plan_inputs(plan, cluster, profile=profile, graph=graph)
    got = PlanInputs(*got)
    covered = cover_graph(plan, got.graph)
    if covered.tensor_parallel:
        return _lowered_tensor_parallel(plan, covered, got, predict)
    sched = build_schedule(got.graph, got.cluster, covered, got.costs, merge=False)
    program = to_program(sched, got.cluster)
    validate(program, f"program of plan for {plan.model.name!r}")
    sim = time_schedule(sched, timeline=False) if predict else None
    return Lowered(plan=plan, covered=covered, inputs=got, program=program, sim=sim)


def _lowered_tensor_parallel(plan: Plan, covered: Plan, got: PlanInputs, predict: bool) -> Lowered:
    """A tensor-parallel plan's Program: the schedule of its first ranks (priced by the
    tensor-parallel cost model), its Program copied for every member (lower/tensor_parallel.py);
    the prediction mirrored onto the members, each event carrying its member's op."""
    split, first, costs = tensor_parallel_inputs(got.graph, got.cluster, covered, got.costs)
    sched = build_schedule(split, got.cluster, first, costs, merge=False)
    firsts = to_program(sched, got.cluster)
    regions = tuple((r.norm, r.column, r.row) for r in megatron_layout(got.graph, vocab_parallel=False).regions)
    program = member_program(firsts, covered, program_devices(covered, got.cluster), regions)
    validate(program, f"program of plan for {plan.model.name!r}")
    sim = None
    if predict:
        capacity = {d: got.cluster.memory_bytes(d) for d in covered.devices()}
        timed = time_schedule(sched, timeline=False)
        sim = mirror_members(
            timed, covered, costs, capacity, op_stride=op_stride(firsts), collectives=collective_events(sched, costs)
        )
    return Lowered(plan=plan, covered=covered, inputs=got, program=program, sim=sim)
