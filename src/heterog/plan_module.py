"""`heterog.plan`: plan a zoo model, a user file, or an in-memory nn.Module.

    heterog.plan("resnet50", batch_size=64, cluster="paper-8gpu")
    heterog.plan(my_module, example_inputs=(x,), targets=y, cluster="paper-8gpu")

A model given by name goes to the planner's entry point unchanged (search/planner.py: plan).
A module is captured here (heterog.capture, on fake tensors: only shapes are used) and the
graph handed to the planner's `plan_graph`, the same function the named path ends in; so
both return the same JSON ({"best", "candidates", "search_time_s"}).

A plan of an in-memory module names its model 'in-memory:NAME'. It can be simulated, lowered
and reported in the interpreter that planned it (its graph is kept there, by fingerprint), but
not run by `heterog run`: the ranks rebuild the model in other processes, and
they cannot import an object that lives only in this interpreter. Running it needs the module
in a file (docs/robustness.md: the user-model convention); the executor says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from heterog.capture.cache import remember_in_memory
from heterog.capture.capture import capture
from heterog.errors import ModelError
from heterog.inputs import model_inputs
from heterog.ir.plan import IN_MEMORY_PREFIX, ModelSpec
from heterog.search import planner
from heterog.search.objective import DEFAULT_TOLERANCE, Goal
from heterog.search.planner import plan_graph


def plan(
    model: str | nn.Module,
    *,
    cluster: Any,
    example_inputs: Any = None,
    targets: Any = None,
    loss_fn: Callable | None = None,
    name: str = "module",
    batch_size: int | None = None,
    model_args: dict[str, Any] | None = None,
    seq_len: int | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
    budget_s: float | None = None,
    seed: int = 0,
    policy: Any = None,
    finetune_s: float = 0.0,
    max_iters: int | None = None,
    progress: Callable[[str, float], None] | None = None,
    objective: str = "time",
    max_cost_per_hour: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, Any]:
    """The best deployment of `model` on `cluster` and the candidates it beat (the CLI's JSON).

    objective: 'time' (the shortest iteration) or 'cost' (the lowest price per sample: the used
    devices' price per hour × iteration time / batch); max_cost_per_hour: the fastest plan whose
    used devices cost at most this many US dollars per hour; tolerance: among plans within this
    fraction of the best, the one on fewer devices, stages and sync methods (search/objective.py).

    model: a zoo name or 'path/file.py:factory' (then batch_size is required), or an
    nn.Module (then example_inputs is required: forward's positional arguments, batch first;
    `targets` and `loss_fn(output, targets)` make the loss, as in heterog.capture).
    """
    extra: dict[str, Any] = {"budget_s": budget_s} if budget_s is not None else {}
    extra["goal"] = Goal(objective=objective, max_cost_per_hour=max_cost_per_hour, tolerance=tolerance)
    if isinstance(model, str):
        if batch_size is None:
            raise ModelError(f"plan({model!r}): give batch_size, the global batch of one iteration.")
        return planner.plan(
            model,
            model_args=model_args,
            batch_size=batch_size,
            seq_len=seq_len,
            cluster=cluster,
            precision=precision,
            optimizer=optimizer,
            seed=seed,
            policy=policy,
            finetune_s=finetune_s,
            max_iters=max_iters,
            progress=progress,
            **extra,
        )
    if not isinstance(model, nn.Module):
        raise ModelError(f"plan() takes a model name or an nn.Module, found {type(model).__name__}.")
    if example_inputs is None:
        raise ModelError(
            "plan(module): give example_inputs=(tensor, ...), forward's positional arguments "
            "with the global batch along dim 0 (only their shapes are used)."
        )
    if model_args:
        raise ModelError("plan(module): model_args apply to named models; build the module with them instead.")
    return _plan_module(
        model,
        example_inputs,
        targets=targets,
        loss_fn=loss_fn,
        name=name,
        cluster=cluster,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        seed=seed,
        policy=policy,
        finetune_s=finetune_s,
        max_iters=max_iters,
        progress=progress,
        **extra,
    )


def _plan_module(
    module: nn.Module,
    example_inputs: Any,
    *,
    targets: Any,
    loss_fn: Callable | None,
    name: str,
    cluster: Any,
    seq_len: int | None,
    precision: str,
    optimizer: str,
    **search: Any,
) -> dict[str, Any]:
    graph = capture(
        module, example_inputs, loss_fn=loss_fn, targets=targets, name=f"{IN_MEMORY_PREFIX}{name}", seq_len=seq_len
    )
    remember_in_memory(graph)  # so heterog.simulate / lower / report of its plan work in this interpreter
    spec = ModelSpec(name=graph.model, batch_size=graph.batch_size, seq_len=seq_len)
    graph, clu, costs = model_inputs(spec, cluster, precision=precision, optimizer=optimizer, graph=graph)
    return plan_graph(graph, clu, costs, model_spec=spec, precision=precision, optimizer=optimizer, **search).to_dict()
