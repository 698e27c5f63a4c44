"""The plans of a module's tests run in one launch of rank processes (heterog.run_many).

A local run spends ~10 s per rank process before its first step (importing torch and
transformers, building and exporting the model) and well under a second per step of these
small models. A test marked `@pytest.mark.batched(plan=builder)` gets its plan (or plans:
`builder` may return a list) from `builder`, called with the test's parameters that
`builder` names; the module-scoped `plan_batch`
fixture (tests/conftest.py) builds the plans of every selected test of the module, runs them
all in one `run_many` launch, and hands each test its own outcome. A plan that fails does not
stop the others (run_many starts fresh processes for the rest), and each test still fails on
its own plan's error.

The module's `BATCH_RUN` (a RunOptions, from `batch_options`) gives run_many's options.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from heterog.ir.plan import Plan
from heterog.ir.run_request import OutputConfig, PredictionConfig, RunOptions
from heterog.ir.run_result import RunResult
from heterog.runs import run_many

Builder = Callable[..., "Plan | list[Plan]"]


def batch_options(**fields: Any) -> RunOptions:
    """A module's BATCH_RUN: no prediction and every rank dumping what it ran, unless `fields`
    (fields of RunOptions) say otherwise."""
    return RunOptions(prediction=PredictionConfig(predict=False), output=OutputConfig(dump_params=True)).with_(**fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchedRun:
    """One plan's outcome in the batch and the folder its ranks wrote to."""

    plan: Plan
    out_dir: Path
    run: RunResult

    def result(self) -> RunResult:
        """What `run` returns for the plan; the plan's own error if it failed."""
        self.run.raise_for_failure()
        return self.run


def _builder_args(builder: Builder, params: dict[str, Any]) -> dict[str, Any]:
    names = inspect.signature(builder).parameters
    return {k: v for k, v in params.items() if k in names}


def _as_list(plans: Plan | list[Plan]) -> list[Plan]:
    return list(plans) if isinstance(plans, (list, tuple)) else [plans]


def _key(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True, default=str)


class PlanBatch:
    """The module's batched plans, run at the first request for any of them."""

    def __init__(self, items: list[pytest.Item], out_dir: Path, options: RunOptions | None) -> None:
        self._items = items
        self._out_dir = out_dir
        given = options or batch_options()
        self._options = given.with_(output=dataclasses.replace(given.output, out_dir=str(out_dir)))
        self._runs: dict[str, BatchedRun] | None = None

    def _plans(self) -> list[Plan]:
        plans: dict[str, Plan] = {}
        for item in self._items:
            builder = item.get_closest_marker("batched").kwargs["plan"]
            params = getattr(item, "callspec", None)
            for plan in _as_list(builder(**_builder_args(builder, params.params if params else {}))):
                plans.setdefault(_key(plan), plan)
        return list(plans.values())

    def _run_all(self) -> dict[str, BatchedRun]:
        plans = self._plans()
        runs = run_many(plans, self._options)
        return {
            _key(p): BatchedRun(plan=p, out_dir=self._out_dir / f"plan{i}", run=r)
            for i, (p, r) in enumerate(zip(plans, runs))
        }

    def get(self, builder: Builder, **params: Any) -> BatchedRun:
        """The outcome of `builder(**params)`'s plan (the batch runs on the first call)."""
        (found,) = self.get_all(builder, **params)
        return found

    def get_all(self, builder: Builder, **params: Any) -> list[BatchedRun]:
        """The outcomes of the plans `builder(**params)` returns, in its order."""
        if self._runs is None:
            self._runs = self._run_all()
        found = [self._runs.get(_key(plan)) for plan in _as_list(builder(**_builder_args(builder, params)))]
        assert None not in found, (
            f"{builder.__name__}({params}) was not in the module's batch: mark the test "
            f"@pytest.mark.batched(plan={builder.__name__})"
        )
        return found  # type: ignore[return-value]


def module_batch(request: pytest.FixtureRequest, out_dir: Path) -> PlanBatch:
    items = [
        it
        for it in request.session.items
        if getattr(it, "module", None) is request.module and it.get_closest_marker("batched")
    ]
    return PlanBatch(items, out_dir, getattr(request.module, "BATCH_RUN", None))
