"""Start the ranks of a plan on this machine, one process per device (on a real cluster:
torchrun.py prints the per-node commands).

Local launch: every rank is a `heterog.execute.worker` process in its own session (so a
SIGINT to the terminal reaches only us, and we can kill a rank's whole process group), with
one thread each. The launcher watches them; when one fails it names the culprit:
  - a rank that died (signal, exit without an error report, or a non-communication error);
  - else, when the others timed out waiting, the ranks still running: they hung;
  - else the first rank that failed.
It then kills every rank left, so no orphans remain, and raises RankError naming it.

Before starting, it removes what dead earlier runs left (stale.py: their temporary run
folders and ranks, network namespaces) and checks that the plan's memory per rank fits in
this machine's free memory (refusing with the numbers unless forced).

`launch_local_many` runs several plans in one set of processes (worker.run_plans), for sweeps
where starting the ranks would cost more than the runs, and for measurements that interleave
plans: the same culprit rules per plan, and after a failing plan the remaining ones start in
fresh processes. Given `processes` (one device each), every plan's rank runs in the process
of its device, so a process keeps its network namespace (netns.py) across plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterog.errors import CheckpointError, HeterogError, PlanError, RankError
from heterog.execute import stale
from heterog.execute.checkpoint import check_same_model, find_checkpoint
from heterog.execute.emulation import KEEP_FREED_MEMORY_ENV
from heterog.execute.spec import FailureKind, LaunchSpec, PlanEntry, RankFailure, RankResult, RankSpec
from heterog.ir.plan import Plan, in_memory_model_error
from heterog.ir.run_request import CheckpointConfig, Fault
from heterog.ir.training_config import TrainingConfig


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How to start one plan's ranks here: `spec`, every rank's spec but for its rank, port and
    folder (the launcher fills those in); each rank's command prefix (a network namespace) and
    extra environment; and whether to start despite memory that looks too small."""

    spec: RankSpec
    wrap: dict[int, list[str]] = field(default_factory=dict)  # rank → command prefix (netns)
    env: dict[int, dict[str, str]] = field(default_factory=dict)  # rank → extra environment
    force: bool = False
    # polled while the ranks run (every 50 ms, before each look at them): True ends them (RunStopped)
    stop: Callable[[], bool] | None = None

    @property
    def devices(self) -> tuple[str, ...]:  # rank → device
        return self.spec.devices


class RunStopped(HeterogError):
    """The caller's `stop` asked the ranks to end (an elastic run's supervisor); they were killed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def launch_local(plan: Plan, cfg: LaunchConfig, out_dir: Path | None = None) -> list[RankResult]:
    """Run every rank of the plan's Program (cfg.spec) on this machine; return the per-rank
    results (rank order)."""
    if (why := in_memory_model_error(plan.model.name)) is not None:
        raise PlanError(why)
    stale.remove_stale_runs()
    stale.check_memory(plan.to_dict(), cfg.devices, force=cfg.force)
    ckpt = _resolve_resume(plan, cfg)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    with _run_dir(out_dir) as work:
        try:
            for rank in range(len(cfg.devices)):
                spec = dataclasses.replace(cfg.spec, rank=rank, checkpoint=ckpt, out_dir=str(work), master_port=port)
                _start_rank(
                    work, spec, f"rank{rank}", procs, logs, wrap=cfg.wrap.get(rank, []), env=cfg.env.get(rank, {})
                )
            _watch(procs, logs, work, cfg)
            return [RankResult.load(RankResult.path(work, r)) for r in range(len(procs))]
        finally:
            _kill_all(procs)


@contextlib.contextmanager
def _run_dir(out_dir: Path | None) -> Iterator[Path]:
    """The run's folder (out_dir, or a temporary one removed after), claimed for this run
    so that stale.remove_stale_runs leaves it alone while it lives."""
    own_dir = out_dir is None
    work = Path(tempfile.mkdtemp(prefix=stale.RUN_PREFIX)) if out_dir is None else Path(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    stale.claim(work)
    try:
        yield work
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)
        stale.release(work)


def _start_rank(
    work: Path,
    spec: RankSpec | LaunchSpec,
    name: str,
    procs: list[subprocess.Popen],
    logs: list[Path],
    *,
    wrap: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> None:
    """Start one worker process on `spec` (written to work/spec_<name>.json, its output to
    work/log_<name>.txt) in a session of its own, and record its pid for stale.py."""
    spec_path = work / f"spec_{name}.json"
    spec.save(spec_path)
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **KEEP_FREED_MEMORY_ENV,
        **(env or {}),
    }
    log = work / f"log_{name}.txt"
    logs.append(log)
    with open(log, "w") as fh:
        procs.append(
            subprocess.Popen(
                [*wrap, sys.executable, "-m", "heterog.execute.worker", str(spec_path)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
        )
    stale.record_ranks(work, [p.pid for p in procs])


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanLaunch:
    """One plan of a multi-plan launch: the plan and its Program's document, its ranks' devices
    (rank r runs in process r) and their compute slowdowns."""

    plan: Plan
    program_doc: dict[str, Any]
    devices: tuple[str, ...]
    slowdowns: dict[str, float] = field(default_factory=dict)
    fault: Fault | None = None  # test hook, as LaunchConfig.fault
    dump_params: bool = False  # as LaunchConfig.dump_params, into the plan's folder
    folder: str = ""  # the plan's folder in the run's; plan<i> if empty
    # entries of one plan (its repetitions) share a key: when one fails, the later ones are
    # not started but get the same error
    key: str = ""
    training: TrainingConfig = field(default_factory=TrainingConfig)  # checked (preflight.check_training)


@dataclass(frozen=True, kw_only=True)
class ProcessLayout:
    """The processes of a multi-plan launch, one per device (a plan's rank runs in the process
    of its device), each with its command prefix and environment (netns.LinkShaping's), and
    the address of process 0, which holds the launch's store."""

    devices: tuple[str, ...]
    wrap: dict[int, list[str]] = field(default_factory=dict)
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"

    def processes_of(self, plan: PlanLaunch) -> list[int]:
        missing = [d for d in plan.devices if d not in self.devices]
        if missing:
            raise PlanError(
                f"the plan's device(s) {missing} have no process in this launch (processes run {list(self.devices)})."
            )
        return [self.devices.index(d) for d in plan.devices]


def launch_local_many(
    plans: list[PlanLaunch],
    *,
    steps: int,
    timeout_s: float = 60.0,
    seed: int = 0,
    out_dir: Path | None = None,
    force: bool = False,
    layout: ProcessLayout | None = None,
) -> list[list[RankResult] | Exception]:
    """Run several plans' Programs one after the other in one set of rank processes
    (worker.run_plans), so the start-up — processes, imports, the model's export — is paid
    once, not per plan. Without `layout`, process r is rank r of every plan that has more than
    r ranks (as many processes as the largest plan has ranks); with it, one process per
    layout device, and each plan's rank runs in its device's process (so shaped links keep
    their namespaces). Returns, per plan, its ranks' results (rank order) or the error that
    stopped it: a failing plan ends its processes, which the launcher names as launch_local
    does, and the plans after it start in fresh ones (entries of a failed plan's key get its
    error without running). CPU ranks (gloo) only; no checkpoints."""
    out: list[list[RankResult] | Exception | None] = [None] * len(plans)
    for i, p in enumerate(plans):
        try:
            if (why := in_memory_model_error(p.plan.model.name)) is not None:
                raise PlanError(why)
            stale.check_memory(p.plan.to_dict(), p.devices, force=force)
            if layout is not None:
                layout.processes_of(p)
        except PlanError as e:
            out[i] = e
    stale.remove_stale_runs()
    with _run_dir(out_dir) as work:
        launch = 0
        while todo := [i for i in range(len(plans)) if out[i] is None]:
            common = LaunchSpec(rank=0, world=0, steps=steps, seed=seed, timeout_s=timeout_s)
            _launch_many(plans, todo, out, work, launch, common, layout=layout)
            failed = {plans[i].key: out[i] for i in range(len(plans)) if isinstance(out[i], Exception)}
            for i in range(len(plans)):
                if out[i] is None and plans[i].key and plans[i].key in failed:
                    out[i] = failed[plans[i].key]
            launch += 1
        return out  # type: ignore[return-value]


def _launch_many(
    plans: list[PlanLaunch],
    todo: list[int],
    out: list,
    work: Path,
    launch: int,
    common: LaunchSpec,
    *,
    layout: ProcessLayout | None,
) -> None:
    """One set of processes for the plans `todo` (in order); fills `out` for every plan that
    finished and for the first that failed. `common`: the launch's settings (steps, seed,
    timeout), which each process's spec takes."""
    steps, timeout_s = common.steps, common.timeout_s
    procs_of = {
        i: layout.processes_of(plans[i]) if layout is not None else list(range(len(plans[i].devices))) for i in todo
    }
    world = len(layout.devices) if layout is not None else max(len(plans[i].devices) for i in todo)
    wait_s = timeout_s * (steps + 3) + 60  # as launch_local's deadline, per plan
    plan_dir = {i: work / (plans[i].folder or f"plan{i}") for i in todo}
    entries = tuple(
        PlanEntry(
            index=i,
            devices=plans[i].devices,
            processes=tuple(procs_of[i]),
            program=plans[i].program_doc,
            slowdowns=plans[i].slowdowns,
            fault=plans[i].fault,
            dump_params=plans[i].dump_params,
            training=plans[i].training,
            out_dir=str(plan_dir[i]),
            wait_s=wait_s,
        )
        for i in todo
    )
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    lay = layout or ProcessLayout(devices=())
    try:
        for rank in range(world):
            spec = dataclasses.replace(
                common, rank=rank, world=world, master_addr=lay.master_addr, master_port=port, plans=entries
            )
            _start_rank(
                work,
                spec,
                f"launch{launch}_rank{rank}",
                procs,
                logs,
                wrap=lay.wrap.get(rank, []),
                env=lay.env.get(rank, {}),
            )
        overdue = RankError(0, "the multi-plan launch exceeded its overall deadline")
        try:
            finished = _wait_all(procs, time.monotonic() + wait_s * len(todo) + 60, lambda stuck: overdue)
        except RankError:
            finished = False
        for i in todo:
            files = [RankResult.path(plan_dir[i], r) for r in range(len(procs_of[i]))]
            if finished or all(f.exists() for f in files):
                out[i] = [RankResult.load(f) for f in files]
                continue
            out[i] = _plan_failure(procs, logs, procs_of[i], plan_dir[i], plans[i].devices, timeout_s)
            return
    finally:
        _kill_all(procs)


def _plan_failure(
    procs: list[subprocess.Popen],
    logs: list[Path],
    mine: list[int],
    folder: Path,
    devices: tuple[str, ...],
    timeout_s: float,
) -> RankError:
    """What stopped a plan of a multi-plan launch: its culprit (launch_local's rules), or a
    process of the launch it does not use that died — to blame only when none of the plan's
    own failed (the store lives in process 0: when that one fails, the idle ones fail after it)."""
    used = [procs[p] for p in mine]
    _grace(used, timeout_s)
    if not any(p.poll() not in (None, 0) for p in used):
        idle_dead = [r for r in range(len(procs)) if r not in mine and procs[r].poll() not in (None, 0)]
        if idle_dead:
            r = idle_dead[0]
            return RankError(
                r,
                f"process {r} of the launch, which this plan does not use, died (exit code "
                f"{procs[r].poll()}); the plan was stopped. Log tail: {_tail(logs[r], 600)}",
            )
    return _culprit(used, [logs[p] for p in mine], folder, devices, timeout_s)


def _resolve_resume(plan: Plan, cfg: LaunchConfig) -> CheckpointConfig:
    """The checkpoint settings with `resume` pinned to one complete checkpoint, so every rank
    loads the same one even if another appears meanwhile; checked against the plan first."""
    ckpt = cfg.spec.checkpoint
    if not ckpt.resume:
        return ckpt
    info = find_checkpoint(ckpt.resume)
    check_same_model(info.model, plan.model.name, f"--resume {ckpt.resume}")
    if info.step >= cfg.spec.steps:
        raise CheckpointError(
            f"--resume {ckpt.resume}: the checkpoint already holds {info.step} "
            f"completed steps and --steps {cfg.spec.steps} is the total to reach; give "
            f"--steps above {info.step}."
        )
    return dataclasses.replace(ckpt, resume=str(info.path))


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _progress(work: Path, rank: int) -> str:
    try:
        return (work / f"progress_rank{rank}").read_text()
    except OSError:
        return "start-up"


def _watch(procs: list[subprocess.Popen], logs: list[Path], work: Path, cfg: LaunchConfig) -> None:
    """Wait for every rank; on the first failure find the culprit and raise RankError."""
    # Start-up (imports, process group) plus every step may each wait up to the timeout;
    # a run that exceeds this overall bound has a rank stuck outside any timed operation.
    deadline = time.monotonic() + cfg.spec.timeout_s * (cfg.spec.steps + 3) + 60
    if _wait_all(
        procs,
        deadline,
        lambda stuck: RankError(
            stuck[0],
            f"the run exceeded its overall deadline; rank(s) {stuck} still running at "
            f"step(s) {[_progress(work, r) for r in stuck]}; killed.",
        ),
        cfg.stop,
    ):
        return
    _grace(procs, cfg.spec.timeout_s)
    raise _culprit(procs, logs, work, cfg.devices, cfg.spec.timeout_s)


def _wait_all(procs: list[subprocess.Popen], deadline: float, overdue, stop: Callable[[], bool] | None = None) -> bool:
    """True when every process exits 0; False as soon as one fails; past the deadline, raise
    `overdue(ranks still running)`; when `stop()` says so, raise RunStopped."""
    while True:
        if stop is not None and stop():
            raise RunStopped("the run was asked to stop; its ranks were ended")
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return True
        if any(c not in (None, 0) for c in codes):
            return False
        if time.monotonic() > deadline:
            raise overdue([r for r, c in enumerate(codes) if c is None])
        time.sleep(0.05)


def _grace(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Give the others a moment to report (a dead peer makes them fail fast)."""
    grace = time.monotonic() + min(5.0, timeout_s)
    while time.monotonic() < grace and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _culprit(
    procs: list[subprocess.Popen], logs: list[Path], work: Path, devices: tuple[str, ...], timeout_s: float
) -> RankError:
    """The RankError that names the rank to blame (module docstring), from the exit codes and
    the error reports in `work`."""
    codes = [p.poll() for p in procs]
    errors = {r: e for r in range(len(procs)) if (e := RankFailure.read(work, r)) is not None}
    died = [
        r
        for r, c in enumerate(codes)
        if c not in (None, 0) and (r not in errors or errors[r].kind is FailureKind.ERROR)
    ]
    alive = [r for r, c in enumerate(codes) if c is None]
    if died:
        r = died[0]
        why = (
            f"failed: {errors[r].type}: {errors[r].message}"
            if r in errors
            else f"died (exit code {codes[r]}) at step {_progress(work, r)}"
        )
        return RankError(r, f"{why} (device {devices[r]}); the run was stopped. Log tail: {_tail(logs[r], 600)}")
    if alive:
        r = alive[0]
        return RankError(
            r,
            f"hung at step {_progress(work, r)} (device {devices[r]}): the other "
            f"ranks timed out after {timeout_s:.0f} s waiting for it; killed.",
        )
    r = min(errors) if errors else 0
    msg = errors[r].message if r in errors else _tail(logs[r])
    return RankError(r, f"failed on device {devices[r]}: {msg}")
