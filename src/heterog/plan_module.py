"""`heterog.plan`: capture → cost → plan, written once for a zoo model, a user file, or an
in-memory nn.Module.

    heterog.plan("resnet50", batch_size=64, cluster="paper-8gpu")
    heterog.plan(my_module, example_inputs=(x,), targets=y, cluster="paper-8gpu")

The three steps are three functions, which `heterog plan`, the Python API and the demo call:
  model_graph   the model's OpGraph: a named model's capture (read from the on-disk cache when
                it was made before, capture/cache.py), or a module captured on fake tensors
                (only shapes are used)
  inputs.model_inputs
                the cluster as its ranks see it and the cost model (a measured profile where
                one is given) — the inputs every prediction of the plan is made from
  search        the planner over those inputs (search/planner.py plan_graph)
so that every way in returns the same JSON ({"best", "candidates", "search_time_s"}).

A plan of an in-memory module names its model 'in-memory:NAME'. It can be simulated, lowered
and reported in the interpreter that planned it (its graph is kept there, by fingerprint), but
not run by `heterog run`: the ranks rebuild the model in other processes, and
they cannot import an object that lives only in this interpreter. Running it needs the module
in a file (docs/robustness.md: the user-model convention); the executor says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from heterog.capture.cache import capture_cached, remember_in_memory
from heterog.capture.capture import capture
from heterog.errors import ModelError, PlanError
from heterog.hardware.spec import cluster_to_dict
from heterog.inputs import PlanInputs, model_inputs
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import IN_MEMORY_PREFIX, ModelSpec, Plan
from heterog.search.objective import DEFAULT_TOLERANCE, Goal
from heterog.search.planner import DEFAULT_BUDGET_S, REQUIRED_STAGES, load_code, plan_graph
from heterog.search.three_d import best_uniform, simulated_3d


def model_graph(
    model: str | nn.Module,
    *,
    batch_size: int | None = None,
    model_args: dict[str, Any] | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    targets: Any = None,
    loss_fn: Callable | None = None,
    name: str = "module",
) -> tuple[ModelSpec, OpGraph]:
    """(the model's spec, its OpGraph). model: a zoo name or 'path/file.py:factory' (then
    batch_size is required), or an nn.Module (then example_inputs is required: forward's
    positional arguments, batch first; `targets` and `loss_fn(output, targets)` make the
    loss, as in heterog.capture)."""
    if isinstance(model, str):
        if batch_size is None:
            raise ModelError(f"plan({model!r}): give batch_size, the global batch of one iteration.")
        spec = ModelSpec(name=model, args=dict(model_args or {}), batch_size=batch_size, seq_len=seq_len)
        return spec, capture_cached(model, model_args, batch_size=batch_size, seq_len=seq_len)
    if not isinstance(model, nn.Module):
        raise ModelError(f"plan() takes a model name or an nn.Module, found {type(model).__name__}.")
    if example_inputs is None:
        raise ModelError(
            "plan(module): give example_inputs=(tensor, ...), forward's positional arguments "
            "with the global batch along dim 0 (only their shapes are used)."
        )
    if model_args:
        raise ModelError("plan(module): model_args apply to named models; build the module with them instead.")
    graph = capture(
        model, example_inputs, loss_fn=loss_fn, targets=targets, name=f"{IN_MEMORY_PREFIX}{name}", seq_len=seq_len
    )
    remember_in_memory(graph)  # so heterog.simulate / lower / report of its plan work in this interpreter
    return ModelSpec(name=graph.model, batch_size=graph.batch_size, seq_len=seq_len), graph


def search(inputs: PlanInputs, spec: ModelSpec, *, precision: str = "fp32", optimizer: str = "sgd", **options: Any):
    """The planner over a model's inputs (search/planner.py plan_graph; `options` are its
    keywords: budget_s, seed, policy, finetune_s, max_iters, progress, …): a PlanResult."""
    graph, cluster, costs = inputs
    return plan_graph(graph, cluster, costs, model_spec=spec, precision=precision, optimizer=optimizer, **options)


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
    profile: Any = None,
    strategy: str | None = None,
    objective: str = "time",
    max_cost_per_hour: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    **options: Any,
) -> dict[str, Any]:
    """The best deployment of `model` on `cluster` and the candidates it beat (the CLI's JSON);
    with `strategy`, also "chosen": that candidate's plan (a baseline's or heterog's), so any
    candidate can be run. model and its arguments: see model_graph; profile: measured
    profiles ('FILE' or 'FILE:TYPE', a Profile or DeviceProfile, or a list), each for one
    device type: their per-node times replace the analytic estimate for the nodes they
    measured, and a GPU's device profile calibrates its type (cost/calibrated.py); `options`:
    the search's (search). Everything from the capture on happens within `budget_s` (the
    clock starts here, after the code every plan needs is loaded: search/planner.py
    load_code); "time_s" says where the time went, "required_s" what no search could skip,
    "over_budget_s" by how much the call overran.
    objective: 'time' (the shortest iteration) or 'cost' (the lowest price per sample: the used
    devices' price per hour × iteration time / batch); max_cost_per_hour: the fastest plan whose
    used devices cost at most this many US dollars per hour; tolerance: among plans within this
    fraction of the best, the one on fewer devices, stages and sync methods (search/objective.py)."""
    separate = objective != "time" or max_cost_per_hour is not None or tolerance != DEFAULT_TOLERANCE
    if "goal" in options and separate:
        raise PlanError(
            "plan() was given both goal= and objective/max_cost_per_hour/tolerance: pass one of them "
            "(a Goal holds all three)"
        )
    options.setdefault("goal", Goal(objective=objective, max_cost_per_hour=max_cost_per_hour, tolerance=tolerance))
    budget_s = options.pop("budget_s", None)
    budget_s = DEFAULT_BUDGET_S if budget_s is None else budget_s
    load_code(options.get("policy"))
    t0 = time.perf_counter()
    spec, graph = model_graph(
        model,
        batch_size=batch_size,
        model_args=model_args,
        seq_len=seq_len,
        example_inputs=example_inputs,
        targets=targets,
        loss_fn=loss_fn,
        name=name,
    )
    t1 = time.perf_counter()
    inputs = model_inputs(spec, cluster, precision=precision, optimizer=optimizer, profile=profile, graph=graph)
    t2 = time.perf_counter()
    result = search(
        inputs, spec, precision=precision, optimizer=optimizer, budget_s=budget_s, deadline_s=t0 + budget_s, **options
    )
    out = result.to_dict()
    before = {"graph": t1 - t0, "cluster_and_costs": t2 - t1}
    out["other_time_s"] = {**before, **out["other_time_s"]}
    out["time_s"] = {**before, **out["time_s"]}
    # what every plan needs before a search can start; when it alone outlasts the budget,
    # the call ends that much later (plus the simulations in flight at the deadline)
    out["required_s"] = sum(out["time_s"].get(k, 0.0) for k in REQUIRED_STAGES)
    out["over_budget_s"] = time.perf_counter() - t0 - budget_s
    out["graph_cache"] = graph.meta.get("graph_cache", "off")
    if strategy is not None:
        out["chosen"] = result.plan_of(strategy).to_dict()
    return out


def plan_3d(
    model: str,
    *,
    cluster: Any,
    tp: int,
    pp: int,
    dp: int,
    batch_size: int | None = None,
    model_args: dict[str, Any] | None = None,
    seq_len: int | None = None,
    stage_layers: list[int] | None = None,
    microbatches: int = 1,
    schedule: str = "1f1b",
    zero: int = 0,
    devices: list[str] | None = None,
    precision: str = "fp32",
    optimizer: str = "sgd",
) -> Plan:
    """The Megatron/DeepSpeed-style tp × pp × dp plan of transformer `model` on `cluster`
    (search/three_d.py: its blocks in `pp` stages, `dp` equal replicas of each, each a
    `tp`-way tensor-parallel set, ranks in Megatron's order or `devices`), with the
    simulator's prediction and the cluster spec in it, as `heterog plan --strategy 3d` writes."""
    spec, graph = model_graph(model, batch_size=batch_size, model_args=model_args, seq_len=seq_len)
    graph, seen, costs = model_inputs(spec, cluster, precision=precision, optimizer=optimizer, graph=graph)
    made, _ = simulated_3d(
        graph,
        seen,
        costs,
        model_spec=spec,
        tp=tp,
        pp=pp,
        dp=dp,
        stage_layers=stage_layers,
        microbatches=microbatches,
        schedule=schedule,
        zero=zero,
        devices=devices,
        precision=precision,
        optimizer=optimizer,
    )
    return replace(made, cluster=cluster_to_dict(seen))


def plan_megatron_3d(
    model: str,
    *,
    cluster: Any,
    batch_size: int | None = None,
    model_args: dict[str, Any] | None = None,
    seq_len: int | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    precision: str = "fp32",
    optimizer: str = "sgd",
) -> Plan:
    """The `megatron-3d` baseline: the best uniform (tp, pp, dp, micro-batches) plan on all of
    `cluster`'s devices, the grid Megatron allows enumerated and scored by the simulator for
    about `budget_s` seconds (search/three_d.py best_uniform), as `heterog plan --strategy
    megatron-3d` writes it."""
    t0 = time.perf_counter()
    spec, graph = model_graph(model, batch_size=batch_size, model_args=model_args, seq_len=seq_len)
    graph, seen, costs = model_inputs(spec, cluster, precision=precision, optimizer=optimizer, graph=graph)
    ranked = best_uniform(graph, seen, costs, spec, deadline_s=t0 + budget_s, precision=precision, optimizer=optimizer)
    if not ranked:
        raise PlanError(f"{spec.name}: no uniform tp × pp × dp configuration covers the {len(seen.devices)} devices.")
    best = ranked[0]
    note = (
        f"megatron-3d: best of {len(ranked)} uniform configurations scored: tp {best.tp}, pp {best.pp}, "
        f"dp {best.dp}, {best.microbatches} micro-batch(es)."
    )
    return replace(best.plan, cluster=cluster_to_dict(seen), notes=(*best.plan.notes, note))
