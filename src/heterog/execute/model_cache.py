"""The model a rank runs, built (and, for a member of a tensor-parallel set, split) and
exported once per model spec in a multi-plan launch (`ModelCache`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch import nn

from heterog.cut.partition import export_plan_model
from heterog.cut.split_export import ExportedModel, copy_exported
from heterog.errors import PlanError
from heterog.execute.tp_rank import TensorParallelState
from heterog.execute.tp_split import ParameterSlice, Regions, TensorParallelRank, split_model
from heterog.ir.plan import Plan
from heterog.workload import Workload, build_model


@dataclass(frozen=True, kw_only=True, slots=True)
class _Built:
    model: nn.Module
    initial: dict[str, torch.Tensor]  # parameters and buffers as built
    rng_state: torch.Tensor  # the CPU generator right after the build
    exported: ExportedModel | None  # None: torch.export refused the model
    cut: dict[str, ParameterSlice]  # tensor parallelism: how the split cut each parameter


@dataclass(kw_only=True)
class ModelCache:
    """The model and its export per model spec (and seed), for the plans of one multi-plan
    launch: exporting takes seconds, more than a 2-step run. Before each plan the parameters,
    the buffers and the random generator are put back as a fresh build leaves them, and the
    plan cuts its own copy of the export (the split rewrites the graph it is given)."""

    built: dict[str, _Built] = field(default_factory=dict)

    def get(
        self, work: Workload, plan: Plan, seed: int, tp: TensorParallelRank | None = None, regions: Regions = ()
    ) -> tuple[nn.Module, ExportedModel | None, dict[str, ParameterSlice]]:
        key = json.dumps(
            [plan.to_dict()["model"], plan.batch_size, seed, str(tp), regions], sort_keys=True, default=str
        )
        entry = self.built.get(key)
        if entry is None:
            model, cut = built_model(work, seed, tp, regions)
            rng_state = torch.get_rng_state()
            try:
                exported = export_plan_model(model, plan)
            except PlanError:
                exported = None  # build_dataflow says why, or runs the model whole
            initial = {k: t.detach().clone() for k, t in [*model.named_parameters(), *model.named_buffers()]}
            entry = self.built[key] = _Built(
                model=model, initial=initial, rng_state=rng_state, exported=exported, cut=cut
            )
        for name, t in [*entry.model.named_parameters(), *entry.model.named_buffers()]:
            t.data = entry.initial[name].clone()
            t.grad = None
        torch.set_rng_state(entry.rng_state)
        return entry.model, (copy_exported(entry.exported) if entry.exported is not None else None), entry.cut


def built_model(
    work: Workload, seed: int, tp: TensorParallelRank | None, regions: Regions = ()
) -> tuple[nn.Module, dict]:
    """The model as built for `seed`, split for this member of a tensor-parallel set (before the
    export: the graph the stages are cut from is the split one); how its parameters were cut."""
    model = build_model(work, seed=seed)
    return model, (split_model(model, tp, regions) if tp is not None else {})


def rank_model(
    models: ModelCache | None, work: Workload, plan: Plan, seed: int, tp: TensorParallelRank | None, regions: Regions
) -> tuple[nn.Module, ExportedModel | None, TensorParallelState | None]:
    """The rank's model and its export (from `models` when given; without, exported by the cut),
    and for a tensor-parallel member its slices."""
    if models is not None:
        model, exported, cut = models.get(work, plan, seed, tp, regions)
    else:
        (model, cut), exported = built_model(work, seed, tp, regions), None
    return model, exported, (TensorParallelState(tp=tp, cut=cut) if tp is not None else None)
