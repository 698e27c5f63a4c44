"""Checks `heterog run` makes before starting any rank, so a mistake is one paragraph in the
launcher, not a traceback in a rank's log minutes later.

- The plan fits the model it will train: the plan is validated against the model's graph
  (the capture the run lowers with, or a fresh one on fake tensors, no weights) and its own
  cluster, fingerprints included. A user model file's content is already checked against the hash the plan
  recorded (ir/plan.py: resolve_model), and its graph fingerprint names the file as it was
  typed when planning, so for user models the node names are checked, not the fingerprint.
- The user's data gives global batches of the plan's size (workload.check_batch).
"""

from __future__ import annotations

from heterog.capture.cache import capture_cached
from heterog.errors import HeterogError, PlanError
from heterog.hardware.spec import cluster_from_dict
from heterog.ir.plan import Plan, user_model_file


def check_plan_fits_model(plan: Plan) -> None:
    """Raise PlanError when the plan was made for another model, arguments or cluster."""
    graph = _capture_for_plan(plan)
    if plan.cluster:  # its own errors say what to do
        plan.validate(cluster=cluster_from_dict(plan.cluster))
    problem = _model_mismatch(plan, graph)
    if problem:
        raise PlanError(
            f"this plan does not fit model {plan.model.name!r} {plan.model.args or ''} as it "
            f"is now: {problem} Re-plan with `heterog plan` for this model, or run the plan "
            f"made for it."
        )


def _capture_for_plan(plan: Plan):
    """The plan's model captured at the plan's batch, or a PlanError saying it cannot be built."""
    try:
        return capture_cached(
            plan.model.name, plan.model.args or None, batch_size=plan.batch_size, seq_len=plan.model.seq_len
        )
    except HeterogError as e:
        raise PlanError(
            f"the plan's model {plan.model.name!r} cannot be built to check the plan against it: {e}"
        ) from None


def _model_mismatch(plan: Plan, graph) -> str | None:
    """Why the plan cannot be for this graph, or None. Loose nodes ('parent::op@k') may be
    left out of a hand-written plan: the executor places them by a fixed rule (partition.py)."""
    for g in plan.groups:
        for n in g.nodes:
            if n not in graph.index:
                return f"group {g.name!r} holds node {n!r}, which the model does not have."
    planned = {n for g in plan.groups for n in g.nodes}
    uncovered = [n.name for n in graph.nodes if "::" not in n.name and n.name not in planned]
    if uncovered:
        return f"model node(s) {uncovered[:3]}{' …' if len(uncovered) > 3 else ''} belong to no group of the plan."
    if (
        plan.graph_fingerprint
        and not user_model_file(plan.model.name)
        and plan.graph_fingerprint != graph.fingerprint()
    ):
        return (
            f"its graph fingerprint is {graph.fingerprint()}, the plan's {plan.graph_fingerprint} (the "
            f"model's structure or costs changed since planning)."
        )
    return None


def check_data(plan: Plan, data: str | None) -> None:
    """Fetch the first batch of --data in this process and check its form."""
    if not data:
        return
    # torch only to check a data loader: `heterog run` imports this module at start-up
    from heterog.workload import check_batch, resolve_workload, with_data

    check_batch(with_data(resolve_workload(plan.model), data), plan.batch_size, source=f"--data {data!r}")
