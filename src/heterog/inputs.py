"""The inputs of every prediction — graph, cluster as its ranks see it, cost model — built once.

`heterog plan`, `simulate`, `report`, `lower` and `run` (and the Python API's plan, simulate,
lower and run) all build a plan's inputs through `model_inputs`, so that they print the same
predicted iteration time for the same plan and cluster. Three things decide that time, and
each is decided here only:
- the graph: the model captured at the plan's batch and sequence length, read from the
  on-disk cache when that capture was made before (capture/cache.py);
- the device model: an emulated cluster's `cpu` devices run as one-thread processes, so their
  rates are this CPU's measured at one thread, whatever thread count the caller has — which
  is left as it is (device_view);
- the costs: the analytic model at the plan's precision and optimizer, with the per-node
  times of a measured profile where one is given.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from heterog.capture.cache import capture_cached, in_memory_graph
from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.hardware.cpu_probe import cpu_gpu_type
from heterog.hardware.spec import cluster_from_dict, load_cluster
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import IN_MEMORY_PREFIX, ModelSpec, Plan
from heterog.lower.program import Program


class PlanInputs(NamedTuple):
    """What a prediction of a plan is made from."""

    graph: OpGraph
    cluster: Cluster  # as the plan's ranks see it (device_view)
    costs: Any  # a CostModel


RANK_THREADS = 1  # torch threads of a rank process (execute/worker.py)


def device_view(cluster: Cluster) -> Cluster:
    """`cluster` as its ranks see this machine: an emulated cluster's `cpu` type measured at
    one thread (each rank runs one). The type records that count (GpuType.cpu_threads), so
    every cost computed from it, now or later, uses the one-thread probe; the caller's own
    thread count is not touched."""
    if cluster.kind != "emulated" or "cpu" not in cluster.gpu_types:
        return cluster
    return dataclasses.replace(cluster, gpu_types={**cluster.gpu_types, "cpu": cpu_gpu_type(RANK_THREADS)})


def load_cluster_like(cluster: Cluster | str | os.PathLike) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    return load_cluster(cluster)


def model_inputs(
    model: ModelSpec,
    cluster: Cluster | str | os.PathLike,
    *,
    precision: str = "fp32",
    optimizer: str = "sgd",
    profile: Any = None,
    graph: OpGraph | None = None,
) -> PlanInputs:
    """The graph, cluster and costs of `model` on `cluster`. graph: the model's capture when the
    caller has it (an in-memory module, `--graph FILE`); profile: measured per-node times (a
    Profile, a DeviceProfile, a file of either, 'FILE:TYPE' or a list; cost/calibrated.py) that
    replace the analytic estimate, a GPU's device profile calibrating its type."""
    # numpy with the cost model, when it is built: the CLI imports this module at start-up
    from heterog.cost import build_cost_model
    from heterog.cost.calibrated import apply_profiles

    if graph is None:  # a model the capture refuses is a ModelError saying why
        graph = capture_cached(model.name, model.args or None, batch_size=model.batch_size, seq_len=model.seq_len)
    seen, node_times = apply_profiles(device_view(load_cluster_like(cluster)), profile)
    return PlanInputs(
        graph, seen, build_cost_model(graph, seen, precision=precision, optimizer=optimizer, profile=node_times)
    )


def plan_inputs(
    plan: Any, *, cluster: Cluster | str | os.PathLike | None = None, graph: OpGraph | None = None, profile: Any = None
) -> PlanInputs:
    """model_inputs for a plan (anything as_plan takes), on the cluster it records unless
    `cluster` is given."""
    plan = as_plan(plan)
    if cluster is None:
        if not plan.cluster:
            raise PlanError(
                "the plan records no cluster (field 'cluster' is empty), so it does not say which "
                "cluster it is for; give one (--cluster NAME_OR_FILE)."
            )
        cluster = cluster_from_dict(plan.cluster)
    if graph is None and plan.model.name.startswith(IN_MEMORY_PREFIX):
        graph = _in_memory_graph(plan)
    return model_inputs(
        plan.model, cluster, precision=plan.precision, optimizer=plan.optimizer, profile=profile, graph=graph
    )


def _in_memory_graph(plan: Plan) -> OpGraph:
    graph = in_memory_graph(plan.graph_fingerprint)
    if graph is None:
        raise PlanError(
            f"the plan was made for an in-memory nn.Module ({plan.model.name!r}) in another "
            f"interpreter, so its graph is not here; plan the module again here, or pass its graph "
            f"(heterog.capture(module, example_inputs)), or put the module in a file "
            f"(docs/robustness.md)."
        )
    return graph


def as_plan(plan: Any, source: str = "<plan>") -> Plan:
    """A Plan from what heterog's own functions return or write: a Plan; a plan's dict (a plan
    result's "best"); a whole plan result (its best plan); a Program (the plan it was lowered
    from); or the path of a plan file, a program file or `heterog plan --json` output."""
    if isinstance(plan, Plan):
        return plan
    best = getattr(plan, "best", None)  # a search.planner.PlanResult
    if isinstance(best, Plan):
        return best
    if isinstance(plan, (str, os.PathLike)):
        return _read_plan(Path(plan))
    if isinstance(plan, dict):
        return _plan_of_doc(plan, source)
    program_plan = getattr(plan, "plan", None)  # a lower.program.Program
    if isinstance(program_plan, dict):
        return Plan.from_dict(program_plan, source)
    raise PlanError(
        f"expected a plan — a Plan, a plan dict (a plan result's 'best'), a plan result, a "
        f"Program, or the path of a plan file — found {type(plan).__name__}."
    )


def _plan_of_doc(doc: dict[str, Any], source: str) -> Plan:
    if doc.get("kind") == "heterog.Program" and isinstance(doc.get("plan"), dict):
        return Plan.from_dict(doc["plan"], f"{source}: plan")
    if "best" in doc and "groups" not in doc:  # heterog.plan()'s result, `heterog plan --json`
        return Plan.from_dict(doc["best"], f"{source}: best")
    return Plan.from_dict(doc, source)


def _read_plan(path: Path) -> Plan:
    """A plan file, the plan a program file was lowered from, or the best of `plan --json`."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None  # Plan.load says what is wrong with the file
    if isinstance(doc, dict) and doc.get("kind") == "heterog.Program":
        return Plan.from_dict(Program.load(path).plan, str(path))
    if isinstance(doc, dict) and "best" in doc and "kind" not in doc:
        return Plan.from_dict(doc["best"], f"{path}: best")
    return Plan.load(path)
