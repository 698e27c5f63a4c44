"""Start the ranks of a plan: locally (one process per device) or by torchrun on each node.

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
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterog.errors import CheckpointError, PlanError, RankError
from heterog.execute import stale
from heterog.execute.checkpoint import check_same_model, find_checkpoint
from heterog.execute.emulation import KEEP_FREED_MEMORY_ENV
from heterog.ir.plan import in_memory_model_error


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    devices: tuple[str, ...]  # rank → device
    steps: int
    timeout_s: float = 60.0  # every collective / p2p op and the start-up
    seed: int = 0
    slowdowns: dict[str, float] = field(default_factory=dict)
    pin_cores: bool = False
    dump_params: bool = False
    fault: dict[str, Any] | None = None  # test hook: {"rank", "kind": die|hang|overflow, "step"}
    data: str | None = None  # user data 'path/file.py:fn' (workload.with_data)
    wrap: dict[int, list[str]] = field(default_factory=dict)  # rank → command prefix (netns)
    env: dict[int, dict[str, str]] = field(default_factory=dict)  # rank → extra environment
    cuda: bool = False  # ranks compute on GPUs (NCCL), else the CPU (gloo)
    cuda_indices: tuple[int, ...] = ()  # rank → its GPU's index here (default: rank r on cuda:r)
    host_staging: bool = False  # ranks share GPUs: gloo, tensors cross through the host
    gpu_types: dict[str, str] = field(default_factory=dict)  # device → the GPU type its rank must find
    master_addr: str = "127.0.0.1"
    checkpoint: dict[str, Any] | None = None  # checkpoint.CheckpointConfig.to_dict()
    force: bool = False  # start even when memory looks too small
    training: dict[str, Any] | None = None  # training.TrainingConfig.to_dict()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def launch_local(
    plan_doc: dict[str, Any], cfg: LaunchConfig, out_dir: Path | None = None, *, program_doc: dict[str, Any]
) -> list[dict]:
    """Run every rank of the plan's Program on this machine; return the per-rank results (rank order)."""
    if (why := in_memory_model_error(plan_doc["model"]["name"])) is not None:
        raise PlanError(why)
    stale.remove_stale_runs()
    stale.check_memory(plan_doc, cfg.devices, force=cfg.force)
    ckpt = _resolve_resume(plan_doc, cfg)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    with _run_dir(out_dir) as work:
        try:
            for rank in range(len(cfg.devices)):
                spec = {
                    "rank": rank,
                    "devices": list(cfg.devices),
                    "program": program_doc,
                    "steps": cfg.steps,
                    "timeout_s": cfg.timeout_s,
                    "seed": cfg.seed,
                    "slowdowns": cfg.slowdowns,
                    "pin_cores": cfg.pin_cores,
                    "dump_params": cfg.dump_params,
                    "fault": cfg.fault,
                    "data": cfg.data,
                    "checkpoint": ckpt,
                    "training": cfg.training,
                    "cuda": cfg.cuda,
                    "out_dir": str(work),
                    "cuda_indices": list(cfg.cuda_indices),
                    "host_staging": cfg.host_staging,
                    "gpu_types": cfg.gpu_types,
                    "master_addr": cfg.master_addr,
                    "master_port": port,
                }
                _start_rank(
                    work, spec, f"rank{rank}", procs, logs, wrap=cfg.wrap.get(rank, []), env=cfg.env.get(rank, {})
                )
            _watch(procs, logs, work, cfg)
            return [json.loads((work / f"result_rank{r}.json").read_text()) for r in range(len(procs))]
        finally:
            _kill_all(procs)


@contextlib.contextmanager
def _run_dir(out_dir: Path | None) -> Iterator[Path]:
    """The run's folder (out_dir, or a temporary one removed after), claimed for this run
    so that stale.remove_stale_runs leaves it alone while it lives."""
    own_dir = out_dir is None
    work = Path(tempfile.mkdtemp(prefix=stale.RUN_PREFIX)) if own_dir else Path(out_dir)
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
    spec: dict[str, Any],
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
    spec_path.write_text(json.dumps(spec))
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
    """One plan of a multi-plan launch: its plan and Program documents, its ranks' devices
    (rank r runs in process r) and their compute slowdowns."""

    plan_doc: dict[str, Any]
    program_doc: dict[str, Any]
    devices: tuple[str, ...]
    slowdowns: dict[str, float] = field(default_factory=dict)
    fault: dict[str, Any] | None = None  # test hook, as LaunchConfig.fault
    dump_params: bool = False  # as LaunchConfig.dump_params, into the plan's folder
    folder: str = ""  # the plan's folder in the run's; plan<i> if empty
    # entries of one plan (its repetitions) share a key: when one fails, the later ones are
    # not started but get the same error
    key: str = ""
    training: dict[str, Any] | None = None  # as LaunchConfig.training


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
) -> list[list[dict] | Exception]:
    """Run several plans' Programs one after the other in one set of rank processes
    (worker.run_plans), so the start-up — processes, imports, the model's export — is paid
    once, not per plan. Without `layout`, process r is rank r of every plan that has more than
    r ranks (as many processes as the largest plan has ranks); with it, one process per
    layout device, and each plan's rank runs in its device's process (so shaped links keep
    their namespaces). Returns, per plan, its ranks' results (rank order) or the error that
    stopped it: a failing plan ends its processes, which the launcher names as launch_local
    does, and the plans after it start in fresh ones (entries of a failed plan's key get its
    error without running). CPU ranks (gloo) only; no checkpoints or user data."""
    out: list[list[dict] | Exception | None] = [None] * len(plans)
    for i, p in enumerate(plans):
        try:
            if (why := in_memory_model_error(p.plan_doc["model"]["name"])) is not None:
                raise PlanError(why)
            stale.check_memory(p.plan_doc, p.devices, force=force)
            if layout is not None:
                layout.processes_of(p)
        except PlanError as e:
            out[i] = e
    stale.remove_stale_runs()
    with _run_dir(out_dir) as work:
        launch = 0
        while todo := [i for i in range(len(plans)) if out[i] is None]:
            _launch_many(plans, todo, out, work, launch, steps=steps, timeout_s=timeout_s, seed=seed, layout=layout)
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
    *,
    steps: int,
    timeout_s: float,
    seed: int,
    layout: ProcessLayout | None,
) -> None:
    """One set of processes for the plans `todo` (in order); fills `out` for every plan that
    finished and for the first that failed."""
    procs_of = {
        i: layout.processes_of(plans[i]) if layout is not None else list(range(len(plans[i].devices))) for i in todo
    }
    world = len(layout.devices) if layout is not None else max(len(plans[i].devices) for i in todo)
    wait_s = timeout_s * (steps + 3) + 60  # as launch_local's deadline, per plan
    plan_dir = {i: work / (plans[i].folder or f"plan{i}") for i in todo}
    entries = [
        {
            "index": i,
            "devices": list(plans[i].devices),
            "processes": procs_of[i],
            "program": plans[i].program_doc,
            "slowdowns": plans[i].slowdowns,
            "fault": plans[i].fault,
            "dump_params": plans[i].dump_params,
            "training": plans[i].training,
            "out_dir": str(plan_dir[i]),
            "wait_s": wait_s,
        }
        for i in todo
    ]
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    lay = layout or ProcessLayout(devices=())
    try:
        for rank in range(world):
            spec = {
                "rank": rank,
                "world": world,
                "steps": steps,
                "timeout_s": timeout_s,
                "seed": seed,
                "master_addr": lay.master_addr,
                "master_port": port,
                "plans": entries,
            }
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
            mine = procs_of[i]
            files = [plan_dir[i] / f"result_rank{r}.json" for r in range(len(mine))]
            if finished or all(f.exists() for f in files):
                out[i] = [json.loads(f.read_text()) for f in files]
                continue
            used = [procs[p] for p in mine]
            _grace(used, timeout_s)
            # a process this plan does not use is to blame only when none of the plan's failed
            # (the store lives in process 0: when that one fails, the idle ones fail after it)
            plan_failed = any(p.poll() not in (None, 0) for p in used)
            idle_dead = (
                [] if plan_failed else [r for r in range(world) if r not in mine and procs[r].poll() not in (None, 0)]
            )
            out[i] = (
                RankError(
                    idle_dead[0],
                    f"process {idle_dead[0]} of the launch, which this plan does not "
                    f"use, died (exit code {procs[idle_dead[0]].poll()}); the plan was "
                    f"stopped. Log tail: {_tail(logs[idle_dead[0]], 600)}",
                )
                if idle_dead
                else _culprit(used, [logs[p] for p in mine], plan_dir[i], plans[i].devices, timeout_s)
            )
            return
    finally:
        _kill_all(procs)


def _resolve_resume(plan_doc: dict[str, Any], cfg: LaunchConfig) -> dict[str, Any] | None:
    """The checkpoint settings with `resume` pinned to one complete checkpoint, so every rank
    loads the same one even if another appears meanwhile; checked against the plan first."""
    if not cfg.checkpoint or not cfg.checkpoint.get("resume"):
        return cfg.checkpoint
    info = find_checkpoint(cfg.checkpoint["resume"])
    check_same_model(info.model, plan_doc["model"]["name"], f"--resume {cfg.checkpoint['resume']}")
    if info.step >= cfg.steps:
        raise CheckpointError(
            f"--resume {cfg.checkpoint['resume']}: the checkpoint already holds {info.step} "
            f"completed steps and --steps {cfg.steps} is the total to reach; give "
            f"--steps above {info.step}."
        )
    return {**cfg.checkpoint, "resume": str(info.path)}


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
    deadline = time.monotonic() + cfg.timeout_s * (cfg.steps + 3) + 60
    if _wait_all(
        procs,
        deadline,
        lambda stuck: RankError(
            stuck[0],
            f"the run exceeded its overall deadline; rank(s) {stuck} still running at "
            f"step(s) {[_progress(work, r) for r in stuck]}; killed.",
        ),
    ):
        return
    _grace(procs, cfg.timeout_s)
    raise _culprit(procs, logs, work, cfg.devices, cfg.timeout_s)


def _wait_all(procs: list[subprocess.Popen], deadline: float, overdue) -> bool:
    """True when every process exits 0; False as soon as one fails; past the deadline, raise
    `overdue(ranks still running)`."""
    while True:
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
    errors = {}
    for r in range(len(procs)):
        f = work / f"error_rank{r}.json"
        if f.exists():
            errors[r] = json.loads(f.read_text())
    died = [r for r, c in enumerate(codes) if c not in (None, 0) and (r not in errors or errors[r]["kind"] == "error")]
    alive = [r for r, c in enumerate(codes) if c is None]
    if died:
        r = died[0]
        why = (
            f"failed: {errors[r]['type']}: {errors[r]['message']}"
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
    msg = errors.get(r, {}).get("message", _tail(logs[r]))
    return RankError(r, f"failed on device {devices[r]}: {msg}")


def local_gpu_indices(node_devices: Sequence[str], used: Sequence[str]) -> list[int]:
    """The GPU index on its node of each used device: its position among the node's devices,
    which a cluster file lists in the order of the node's GPUs (CUDA_VISIBLE_DEVICES order)."""
    return [list(node_devices).index(d) for d in used]


def torchrun_commands(
    *,
    spec_path: str,
    node_devices: list[list[str]],
    master_addr: str,
    master_port: int = 29500,
    env: dict[str, str] | None = None,
    visible: list[list[int]] | None = None,
) -> list[str]:
    """One torchrun command per node; rank order follows node order, then device order. `env`
    (e.g. one NCCL algorithm for unlike GPUs) prefixes every command; `visible[i]`, node i's
    GPUs the plan uses, becomes its CUDA_VISIBLE_DEVICES, so local rank k runs on the k-th of
    them — the GPU its plan device names, also when the plan leaves some of the node's out."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    out = []
    for i, devs in enumerate(node_devices):
        gpus = [f"CUDA_VISIBLE_DEVICES={','.join(map(str, visible[i]))}"] if visible else []
        out.append(
            " ".join(
                [
                    *prefix,
                    *gpus,
                    "torchrun",
                    f"--nnodes={len(node_devices)}",
                    f"--node-rank={i}",
                    f"--nproc-per-node={len(devs)}",
                    f"--master-addr={shlex.quote(master_addr)}",
                    f"--master-port={master_port}",
                    "-m",
                    "heterog.execute.worker",
                    shlex.quote(spec_path),
                ]
            )
        )
    return out
