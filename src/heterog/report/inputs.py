"""What a report is made of, read from the files the other commands write.

A report needs a Plan and the SimResult of that plan; it can also show the planner's
candidates (in `heterog plan --json` output, not in a plan file) and a measured run (the
RunResult `heterog run --out` writes). Each is checked as it is read, and a file that is
not what it should be says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterog.errors import ArtifactError
from heterog.ir.plan import KIND as PLAN_KIND
from heterog.ir.plan import Plan
from heterog.ir.run_result import RunResult


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One row of the planner's candidates table (search/planner.py Candidate.to_dict)."""

    strategy: str
    iteration_time_s: float | None
    feasible: bool
    peak_memory_bytes: dict[str, int]
    devices_used: int
    num_microbatches: int
    cost: dict[str, float] = field(default_factory=dict)  # search/objective.py cost_figures; {} unpriced

    @property
    def max_peak_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes.values(), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanFile:
    """A plan, with the candidates table when the file came from `heterog plan --json`."""

    plan: Plan
    candidates: tuple[Candidate, ...] = field(default=())
    search_time_s: float | None = None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file; pass the {what}.") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not JSON ({e.msg} at line {e.lineno}); pass the {what}.") from None


def load_plan_file(path: Path) -> PlanFile:
    """A plan file (`heterog plan --out`) or the planner's JSON (`heterog plan --json`, which
    holds the best plan and every candidate)."""
    doc = _read_json(path, "plan file from `heterog plan --out` or the output of `heterog plan --json`")
    if isinstance(doc, dict) and "best" in doc and "candidates" in doc:
        cands = tuple(candidate_from_dict(c, f"{path}: candidates[{i}]") for i, c in enumerate(doc["candidates"]))
        return PlanFile(
            plan=Plan.from_dict(doc["best"], f"{path}: best"), candidates=cands, search_time_s=doc.get("search_time_s")
        )
    if isinstance(doc, dict) and doc.get("kind") == PLAN_KIND:
        return PlanFile(plan=Plan.load(path))
    raise ArtifactError(
        f"{path}: neither a plan (kind {PLAN_KIND!r}) nor `heterog plan --json` output "
        f"(keys 'best' and 'candidates'); write one with `heterog plan ... --out plan.json`."
    )


def candidate_from_dict(doc: dict[str, Any], where: str) -> Candidate:
    try:
        return Candidate(
            strategy=str(doc["strategy"]),
            iteration_time_s=doc.get("iteration_time_s"),
            feasible=bool(doc["feasible"]),
            peak_memory_bytes={k: int(v) for k, v in doc.get("peak_memory_bytes", {}).items()},
            devices_used=int(doc.get("devices_used", 0)),
            num_microbatches=int(doc.get("num_microbatches", 1)),
            cost={str(k): float(v) for k, v in (doc.get("cost") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{where}: not a candidate of `heterog plan --json` ({e!r}).") from None


def load_run(path: Path) -> RunResult:
    """The run result that `heterog run --out RUN.json` writes (or prints with --json)."""
    try:
        run = RunResult.load(path)
    except ArtifactError as e:
        raise ArtifactError(
            f"{e} --run takes the result of a run: write one with `heterog run plan.json --out run.json`."
        ) from None
    if run.failure is not None:
        raise ArtifactError(
            f"{path}: the run failed ({run.failure.type}: {run.failure.message}); nothing was measured."
        )
    return run
