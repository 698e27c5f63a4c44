"""What a run records of where its state comes from and goes: the plan and cluster its
checkpoints are saved under (each marker holds them), and the checkpoint it resumed from
(RunResult.resumed_from), for a run resumed by hand (`--resume`) as for an elastic one."""

from __future__ import annotations

import dataclasses

from heterog.execute.checkpoint import find_checkpoint
from heterog.hardware.cluster import Cluster
from heterog.ir.plan import Plan
from heterog.ir.provenance import ResumePoint, SavedUnder
from heterog.ir.run_request import RunOptions


def saved_under(plan: Plan, cluster: Cluster, devices: tuple[str, ...]) -> SavedUnder:
    return SavedUnder(
        strategy=plan.strategy,
        devices=devices,
        cluster=cluster.name,
        cluster_fingerprint=plan.cluster_fingerprint or cluster.fingerprint(),
        predicted_iteration_time_s=plan.predicted_iteration_time_s,
    )


def pinned_resume(
    plan: Plan, cluster: Cluster, devices: tuple[str, ...], options: RunOptions
) -> tuple[RunOptions, ResumePoint | None]:
    """`options` with the checkpoint to resume pinned to one folder (the last complete one
    now: what the ranks load, and what the result names) and the plan the new checkpoints are
    saved under; and that resume point (None without --resume)."""
    ckpt = options.checkpoint
    if ckpt.dir:
        ckpt = dataclasses.replace(ckpt, saved_under=saved_under(plan, cluster, devices))
    point = None
    if ckpt.resume:
        info = find_checkpoint(ckpt.resume)
        ckpt = dataclasses.replace(ckpt, resume=str(info.path))
        point = ResumePoint(checkpoint=str(info.path), step=info.step, saved_under=info.saved_under)
    return dataclasses.replace(options, checkpoint=ckpt), point
