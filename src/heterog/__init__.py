"""heterog: plan and run fast training on clusters of unlike GPUs.

The stable Python API (the same keys as the CLI's --json output):

    capture(model, example_inputs)       nn.Module → OpGraph
    load_cluster(name_or_yaml)           → Cluster
    predict(model, batch_size=, device=) one device, one training step
    plan(model, batch_size=, cluster=)   → {"best", "candidates", "search_time_s"}
    plan_inputs(plan)                    → (graph, cluster, costs) every prediction uses
    lower(plan)                          → Program (per-device instructions)
    simulate(plan)                       → SimResult (or simulate(graph, cluster, plan, costs))
    run(plan, steps=)                    → RunResult: measured beside predicted, per step, rank
                                           and instruction (options: RunOptions; training
                                           options: TrainingConfig)
    run_many(plans, steps=)              → one RunResult per plan, in one launch
    run_interleaved(plans, timing=)      → one RunResult per plan, rounds interleaved
    run_elastic(plan, options, ElasticConfig(devices_file=))  → RunResult with its re-plans
    whatif(model, batch_size=, cluster=, add=, remove=)  → WhatIf: each change planned, beside even DP

Wherever a plan is taken, a Plan, its dict (a plan result's "best"), a whole plan result, or a
path to a plan, program or `heterog plan --json` file is accepted. Imports are lazy so that
the command line starts fast and stages load only what they use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.1.0"

# name → (module, attribute)
_API: dict[str, tuple[str, str]] = {
    "capture": ("heterog.capture.capture", "capture"),
    "load_cluster": ("heterog.hardware.spec", "load_cluster"),
    "predict": ("heterog.cost.predict", "predict"),
    "plan": ("heterog.plan_module", "plan"),
    "plan_3d": ("heterog.plan_module", "plan_3d"),
    "plan_megatron_3d": ("heterog.plan_module", "plan_megatron_3d"),
    "plan_inputs": ("heterog.inputs", "plan_inputs"),
    "lower": ("heterog.orchestrate", "lower"),
    "simulate": ("heterog.orchestrate", "simulate"),
    "run": ("heterog.runs.api", "run"),
    "run_many": ("heterog.runs.api", "run_many"),
    "run_interleaved": ("heterog.runs.api", "run_interleaved"),
    "run_elastic": ("heterog.runs.elastic", "run_elastic"),
    "ElasticConfig": ("heterog.runs.elastic", "ElasticConfig"),
    "RunOptions": ("heterog.ir.run_request", "RunOptions"),
    "RunRequest": ("heterog.ir.run_request", "RunRequest"),
    "RunResult": ("heterog.ir.run_result", "RunResult"),
    "TrainingConfig": ("heterog.ir.training_config", "TrainingConfig"),
    "whatif": ("heterog.cluster_change", "whatif"),
    "OpGraph": ("heterog.ir.opgraph", "OpGraph"),
    "Plan": ("heterog.ir.plan", "Plan"),
    "Cluster": ("heterog.hardware.cluster", "Cluster"),
    "HeterogError": ("heterog.errors", "HeterogError"),
}
# API names that are also subpackages: `heterog.X` is the (callable) package, so that
# heterog.capture.zoo and heterog.capture(model, inputs) both work
_PACKAGES = frozenset({"capture", "simulate", "lower"})

__all__ = sorted(_API)


def api_function(name: str) -> Callable[..., Any]:
    """The function (or class) the API calls `name`."""
    module, attr = _API[name]
    return getattr(importlib.import_module(module), attr)


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        return importlib.import_module(f"heterog.{name}")
    if name in _API:
        return api_function(name)
    raise AttributeError(f"module 'heterog' has no attribute {name!r}")
