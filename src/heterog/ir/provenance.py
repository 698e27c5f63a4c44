"""Where a run's state came from: the plan and cluster a checkpoint was saved under, the
checkpoint a run resumed from, and an elastic run's re-plans (runs/elastic.py).

  SavedUnder   what a checkpoint's marker records of the run that wrote it (execute/checkpoint.py)
  ResumePoint  the checkpoint a run resumed from: its folder, its step, and its SavedUnder
  PlanSummary  a plan as a re-plan reports it: strategy, devices, predicted iteration time
  Replan       one re-plan of an elastic run: when, why, the plans before and after, and how
               long the run took to recover (from the loss to the next completed step)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from heterog.jsonio import Record


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedUnder(Record):
    """The plan and cluster a checkpoint was written under."""

    strategy: str
    devices: tuple[str, ...]  # the run's ranks, in rank order
    cluster: str | None
    cluster_fingerprint: str = ""
    predicted_iteration_time_s: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumePoint(Record):
    """The checkpoint a run resumed from (None fields: a checkpoint written before markers
    recorded the plan)."""

    checkpoint: str  # the checkpoint's folder
    step: int  # completed steps it holds: the run went on from the next
    saved_under: SavedUnder | None = None

    def describe(self) -> str:
        under = self.saved_under
        where = (
            f", saved under plan {under.strategy!r} on {', '.join(under.devices)} of cluster {under.cluster}"
            if under is not None
            else ""
        )
        return f"resumed from {self.checkpoint} after step {self.step}{where}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary(Record):
    strategy: str
    devices: tuple[str, ...]
    cluster_devices: tuple[str, ...]  # the devices it was planned for (it may leave some idle)
    predicted_iteration_time_s: float | None


class ReplanReason(StrEnum):
    DEVICE_LOST = "device-lost"  # a rank's process died or stopped answering
    CLUSTER_CHANGED = "cluster-changed"  # the device list or cluster file changed, or SIGHUP


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan(Record):
    """One re-plan of an elastic run. `at_s`: wall-clock seconds since the epoch when the loss
    or change was seen; `recovery_s`: from then to the end of the next completed step (None
    when the run stopped again before one)."""

    at_s: float
    reason: ReplanReason
    detail: str
    lost: tuple[str, ...]  # devices excluded from the re-plan
    added: tuple[str, ...]  # devices the re-plan may use that the old plan's cluster lacked
    old: PlanSummary
    new: PlanSummary
    replan_s: float  # the warm-started search, with its inputs
    search_budget_s: float
    resumed_from: ResumePoint | None  # None: lost before the first checkpoint, started again
    recovery_s: float | None = None

    def describe(self) -> str:
        def plan(p: PlanSummary) -> str:
            t = p.predicted_iteration_time_s
            return f"{p.strategy} on {len(p.devices)} device(s) ({', '.join(p.devices)})" + (
                f", predicted {t * 1e3:.1f} ms" if t is not None else ""
            )

        rec = f"; recovered in {self.recovery_s:.1f} s" if self.recovery_s is not None else ""
        return (
            f"re-plan ({self.reason}: {self.detail}): {plan(self.old)} → {plan(self.new)}; searched "
            f"{self.replan_s:.1f} s; "
            + (f"resumed after step {self.resumed_from.step}" if self.resumed_from else "started again")
            + rec
        )
