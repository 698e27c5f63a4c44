"""Checks `heterog run` makes before starting any rank, so a mistake is one paragraph in the
launcher, not a traceback in a rank's log minutes later.

- The plan fits the model it will train: the plan is validated against the model's graph
  (the capture the run lowers with, or a fresh one on fake tensors, no weights) and its own
  cluster, fingerprints included. A user model file's content is already checked against the hash the plan
  recorded (ir/plan.py: resolve_model), and its graph fingerprint names the file as it was
  typed when planning, so for user models the node names are checked, not the fingerprint.
- The user's data gives global batches of the plan's size (workload.check_batch), and the
  first batch's token ids and sequence length fit the model (check_inputs).
- The training options fit the plan and the user's model file (check_training).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from heterog.capture.cache import capture_cached
from heterog.errors import HeterogError, PlanError, TrainingError
from heterog.hardware.spec import cluster_from_dict
from heterog.ir.plan import Plan, user_model_file
from heterog.ir.training_config import TrainingConfig


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


def check_inputs(plan: Plan, data: str | None) -> None:
    """The first batch (the user's, or the synthetic one) against the model's sequence limit
    and vocabulary (capture/limits.py), read from the model built on the meta device."""
    # torch only to check inputs: `heterog run` imports this module at start-up
    import torch

    from heterog.capture.limits import check_batch_inputs, input_limits
    from heterog.workload import global_batch, resolve_workload, with_data

    work = with_data(resolve_workload(plan.model), data)
    with torch.device("meta"):
        limits = input_limits(work.build())
    if limits.max_positions is None and limits.vocab_size is None:
        return  # no token inputs to check: do not draw a batch
    inputs, _ = global_batch(work, plan.batch_size, seed=0, step=0)
    source = f"--data {data!r}" if data else f"model {plan.model.name!r}'s example batch"
    check_batch_inputs(limits, inputs, model_name=plan.model.name, source=source)


def check_training(plan: Plan, config: TrainingConfig, *, steps: int) -> TrainingConfig:
    """The training options checked against the plan and the user's model file before any
    rank starts; returned as the ranks get them (a decaying schedule's horizon: `steps`).
    The user's optimizer is made over a stand-in parameter and stepped once, so a failing
    factory, or one that keeps more state per parameter than the plan's memory model counts
    for its --optimizer (cost/memory.py), is refused here."""
    # torch only to check inputs: `heterog run` imports this module at start-up
    from heterog.training import Recipe, UserTraining, evaluate_signature_ok
    from heterog.workload import check_batch, resolve_workload, with_data

    if config.decay_steps is None:
        config = dataclasses.replace(config, decay_steps=steps)
    user = UserTraining.of_model(plan.model.name)
    config.check_for(plan.optimizer, user)
    recipe = Recipe(kind=plan.optimizer, config=config, user=user, steps=steps)
    _check_state_size(plan, recipe)
    if user.evaluate is not None and not evaluate_signature_ok(user.evaluate):
        raise TrainingError(f"{user.source}: evaluate must take (outputs, targets).")
    if config.eval_every and user.eval_loader is not None:
        spec = f"{user_model_file(plan.model.name)[0]}:eval_loader"  # type: ignore[index]
        check_batch(
            with_data(resolve_workload(plan.model), spec), plan.batch_size, source=f"{user.source}: eval_loader"
        )
    if config.log_dir:
        try:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"--log-dir {config.log_dir}: cannot create it ({e}).") from None
    return config


def _check_state_size(plan: Plan, recipe) -> None:
    """The optimizer's state per parameter within what the plan's memory model counts."""
    # torch only to check inputs: `heterog run` imports this module at start-up
    import torch

    from heterog.cost.memory import OPTIMIZER_STATE_COPIES

    probe = torch.nn.Parameter(torch.zeros(4, 4))
    opt = recipe.make_optimizer([probe])
    probe.grad = torch.ones_like(probe)
    opt.step()
    copies = sum(v.numel() for v in opt.state.get(probe, {}).values() if torch.is_tensor(v) and v.dim()) / probe.numel()
    planned = OPTIMIZER_STATE_COPIES.get(plan.optimizer, 0)
    if copies > planned:
        raise TrainingError(
            f"the optimizer ({type(opt).__name__}) keeps {copies:g} parameter-sized state tensor(s) per "
            f"parameter, but the plan was made with --optimizer {plan.optimizer}, whose memory model counts "
            f"{planned}; re-plan with --optimizer adamw (2 copies) so the plan's memory holds."
        )
