"""Elastic runs: a supervisor that re-plans when devices come and go, and goes on training.

    heterog.run_elastic(plan, RunOptions(steps=15, checkpoint=…), ElasticConfig(devices_file="devices.txt"))
    heterog run PLAN --elastic --elastic-devices devices.txt --checkpoint-dir D --checkpoint-every 1
    (--elastic-devices cluster.yaml: a cluster file's devices are the ones available)

The run is a sequence of launches of the rank processes (runs/api.py), one per plan. During a
launch the supervisor watches two things:
  - a lost device: a rank's process dies or stops answering; the launcher names the rank
    (execute/launcher.py), and its device is excluded from the cluster until it appears again;
  - a changed cluster: the device list file (one device name per line, `#` comments) or the
    cluster file (a cluster YAML: its devices are the ones available), re-read between steps
    when it changed on disk, and at once on SIGHUP. A device lost earlier that a new content
    of the file lists (or that the file lists at a SIGHUP) appears again.
On a loss the launch has already stopped. On a change of the devices the run may use, the
supervisor lets the ranks finish the next complete checkpoint and then ends them, so the
stop costs no step. Either way it re-plans for the devices it now has — the planner's search
with a short budget (`replan_budget_s`), warm-started from the current plan restricted to the
surviving devices (search/warm.py) beside the usual starts — and launches the new plan,
resumed from the last complete checkpoint (parameters and optimizer state load by name under
any plan: execute/checkpoint.py), until the requested steps are done.

Each re-plan is a Replan record in the result (ir/provenance.py): when and why, the devices
and predicted time of the plans before and after, the search's time, the checkpoint resumed
from, and the time to recover — from the moment the launcher saw the loss (it looks at the
ranks every 50 ms and polls the supervisor just before; that poll dates it) or the supervisor
saw the change, to the end of the next completed step (seen in the ranks' step files).

torchrun's elastic agent is not used (docs/robustness.md says why): it restarts the same
worker spec — entry point, arguments and processes per node — when a worker fails or agents
join or leave the rendezvous, with no step between the membership change and the restart
where a new plan could be made and handed to the ranks; and membership is counted in agents
(nodes), so a device lost inside a node — every emulated device here — is not a change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heterog.errors import CheckpointError, ClusterError, HeterogError, RankError
from heterog.execute.checkpoint import MARKER, STEP_PREFIX, CheckpointInfo, find_checkpoint, read_marker
from heterog.execute.launcher import RunStopped
from heterog.execute.steplog import STEPS_FILE, read_records
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_from_dict, cluster_to_dict, parse_cluster_yaml
from heterog.inputs import as_plan, model_inputs
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Plan
from heterog.ir.provenance import PlanSummary, Replan, ReplanReason, ResumePoint
from heterog.ir.run_request import RunOptions
from heterog.ir.run_result import RunResult
from heterog.jsonio import Record
from heterog.lower.tensor_parallel import executor_tensor_parallel
from heterog.orchestrate import cluster_of
from heterog.plan_module import search
from heterog.runs.api import _alone
from heterog.runs.layout import local_ranks
from heterog.search.constraints import DEFAULT_CACHE

LOOK_EVERY_S = 0.2  # how often the supervisor reads the device file and the ranks' step files


class ElasticError(HeterogError):
    """An elastic run cannot go on: no device left, too many re-plans, a bad device file."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticConfig(Record):
    """devices_file: the devices available now, one name per line (names of the plan's cluster);
    cluster_file: a cluster YAML whose devices are the ones available (it may name new ones);
    neither: the plan's cluster, less the devices lost. replan_budget_s: each re-plan's search;
    max_replans: the run gives up after this many."""

    devices_file: str | None = None
    cluster_file: str | None = None
    replan_budget_s: float = 3.0
    max_replans: int = 10

    def __post_init__(self) -> None:
        if self.devices_file and self.cluster_file:
            raise ElasticError("watch a device list or a cluster file, not both.")
        if not self.replan_budget_s > 0 or self.max_replans < 1:
            raise ElasticError(
                f"--replan-budget-s must be > 0 and max_replans ≥ 1, found {self.replan_budget_s} and "
                f"{self.max_replans}."
            )


def cluster_subset(cluster: Cluster, names: set[str]) -> Cluster:
    """`cluster` with only the devices `names` (nodes left empty dropped)."""
    doc = cluster_to_dict(cluster)
    for node in doc["nodes"]:
        node["devices"] = [d for d in node["devices"] if d["name"] in names]
    doc["nodes"] = [n for n in doc["nodes"] if n["devices"]]
    if not doc["nodes"]:
        raise ElasticError(f"no device of cluster {cluster.name!r} is left to train on.")
    if len(names) < len(cluster.devices):
        doc["name"] = f"{cluster.name} ({sum(len(n['devices']) for n in doc['nodes'])} of {len(cluster.devices)})"
    return cluster_from_dict(doc)


class DeviceWatch:
    """The devices the run may use now: the watched file's (or the plan's cluster), less the
    devices lost. `poll` re-reads the file when it changed on disk or SIGHUP asked."""

    def __init__(self, config: ElasticConfig, base: Cluster):
        self.path = Path(config.devices_file or config.cluster_file or "")
        self.watching = bool(config.devices_file or config.cluster_file)
        self.is_cluster = bool(config.cluster_file)
        self.base = base
        self.lost: set[str] = set()
        self.hup = threading.Event()
        self._stamp: tuple[int, int] | None = None
        self._text: str | None = None
        self.cluster = base
        if self.watching:
            self.poll()

    def poll(self) -> bool:
        """Re-read the file when it changed on disk or SIGHUP asked; True when its content is
        new (or SIGHUP). Devices it lists are no longer lost."""
        forced = self.hup.is_set()
        self.hup.clear()
        if not self.watching:
            if forced:
                self.lost.clear()
            return forced
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if not forced and stamp == self._stamp:
                return False
            text = self.path.read_text()
        except OSError as e:
            if self._text is None:
                raise ElasticError(f"{self.path}: cannot read the elastic run's device file ({e}).") from None
            return False  # being replaced: read it at the next look
        self._stamp = stamp
        if not forced and text == self._text:
            return False
        self.cluster = self._parse(text)
        self._text = text
        self.lost -= {d.name for d in self.cluster.devices}
        return True

    def _parse(self, text: str) -> Cluster:
        if self.is_cluster:
            try:
                return parse_cluster_yaml(text, str(self.path), self.path.parent)
            except ClusterError as e:
                raise ElasticError(f"{self.path}: {e}") from None
        names = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        names = [n for n in names if n]
        known = {d.name for d in self.base.devices}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ElasticError(
                f"{self.path}: device(s) {unknown} are not in the plan's cluster {self.base.name!r} (its devices: "
                f"{', '.join(sorted(known))}); list one of those per line, or watch a cluster file "
                f"(--elastic-devices cluster.yaml) to bring new devices."
            )
        return cluster_subset(self.base, set(names))

    def devices(self) -> frozenset[str]:
        return frozenset(d.name for d in self.cluster.devices) - self.lost

    def available(self) -> Cluster:
        return cluster_subset(self.cluster, set(self.devices()))


def newest_checkpoint(root: str | Path, since_s: float) -> CheckpointInfo | None:
    """The newest complete checkpoint under `root` written since `since_s` (wall clock: an
    earlier run's checkpoints in the same folder are not this run's), or None."""
    for folder in sorted(Path(root).glob(f"{STEP_PREFIX}*"), reverse=True):
        info = read_marker(folder)
        if info is not None and (folder / MARKER).stat().st_mtime >= since_s:
            return info
    return None


class _Launch:
    """The supervisor's view of one launch, polled by the launcher (LaunchConfig.stop): when
    the devices change, stop after the next complete checkpoint; note when the first step of
    the launch completes (every rank's step file has a line)."""

    def __init__(
        self, watch: DeviceWatch, planned_for: frozenset[str], checkpoints: Callable[[], int], folder: Path, ranks: int
    ):
        self.watch, self.planned_for, self.checkpoints = watch, planned_for, checkpoints  # checkpoints: newest step
        self.folder, self.ranks = folder, ranks
        self.last_poll_s = time.time()
        self.changed_at_s: float | None = None
        self.first_step_at_s: float | None = None
        self._looked_s = 0.0
        self._since_step = -1

    def __call__(self) -> bool:
        now = self.last_poll_s = time.time()
        if now - self._looked_s < LOOK_EVERY_S:
            return False
        self._looked_s = now
        if self.first_step_at_s is None and all(
            read_records(self.folder / STEPS_FILE.format(rank=r)) for r in range(self.ranks)
        ):
            self.first_step_at_s = now
        if self.changed_at_s is None and self.watch.poll() and self.watch.devices() != self.planned_for:
            self.changed_at_s = now
            self._since_step = self.checkpoints()
        return self.changed_at_s is not None and self.checkpoints() > self._since_step


def replan(plan: Plan, cluster: Cluster, budget_s: float, *, graph: OpGraph | None = None, seed: int = 0) -> Plan:
    """The best plan of `plan`'s model on `cluster`, from a `budget_s` search (its costs
    included) warm-started from `plan` (search/warm.py); no GNN lane (its imports alone take
    seconds)."""
    t0 = time.perf_counter()
    inputs = model_inputs(plan.model, cluster, precision=plan.precision, optimizer=plan.optimizer, graph=graph)
    result = search(
        inputs,
        plan.model,
        precision=plan.precision,
        optimizer=plan.optimizer,
        budget_s=budget_s,
        deadline_s=t0 + budget_s,
        starts=[plan],
        policy=False,
        seed=seed,
        tensor_parallel=executor_tensor_parallel(),  # the re-plan is run at once
    )
    return result.best


def _summary(plan: Plan) -> PlanSummary:
    cluster, devices = local_ranks(plan)
    return PlanSummary(
        strategy=plan.strategy,
        devices=devices,
        cluster_devices=tuple(d.name for d in cluster.devices),
        predicted_iteration_time_s=plan.predicted_iteration_time_s,
    )


@contextlib.contextmanager
def _sighup(watch: DeviceWatch) -> Iterator[None]:
    """SIGHUP asks for a re-check of the devices (main thread only)."""
    try:
        old = signal.signal(signal.SIGHUP, lambda *_: watch.hup.set())
    except (ValueError, AttributeError):  # not the main thread, or no SIGHUP here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)


@dataclass(frozen=True, kw_only=True)
class _Stop:
    """Why a launch stopped: what the re-plan record says."""

    at_s: float
    reason: ReplanReason
    detail: str


def _stopped(error: Exception, launch: _Launch, plan: Plan, watch: DeviceWatch) -> _Stop:
    if isinstance(error, RankError):
        device = local_ranks(plan)[1][error.rank]
        watch.lost.add(device)
        why = error.message.split(" Log tail:")[0]
        return _Stop(at_s=launch.last_poll_s, reason=ReplanReason.DEVICE_LOST, detail=f"rank {error.rank}: {why}")
    assert launch.changed_at_s is not None  # RunStopped comes from the change
    return _Stop(
        at_s=launch.changed_at_s,
        reason=ReplanReason.CLUSTER_CHANGED,
        detail=f"devices now {', '.join(sorted(watch.devices()))}",
    )


def run_elastic(
    plan: Any,
    options: RunOptions,
    elastic: ElasticConfig | None = None,
    *,
    inputs: Any = None,
    say: Callable[[str], None] | None = None,
) -> RunResult:
    """Train `plan` `options.steps` steps, re-planning when devices are lost or the cluster
    changes (module docstring). Needs checkpoints (options.checkpoint: dir and every_steps);
    options.output.out_dir keeps each launch's files in `launch<k>/`. The result is the last
    launch's, with every re-plan (`replans`) and the checkpoint that launch resumed from."""
    plan, cfg = as_plan(plan), elastic or ElasticConfig()
    ckpt = options.checkpoint
    if not (ckpt.dir and ckpt.every_steps):
        raise CheckpointError(
            "an elastic run resumes from its checkpoints: give --checkpoint-dir DIR and --checkpoint-every N."
        )
    if options.timing.repetitions != 1:
        raise ElasticError("an elastic run is one run: --repetitions must be 1.")
    note, since_s = say or (lambda text: None), time.time()
    watch = DeviceWatch(cfg, cluster_of(plan))

    def newest() -> int:  # the step of this run's newest complete checkpoint
        info = newest_checkpoint(str(ckpt.dir), since_s)
        return info.step if info is not None else -1

    def resume_point() -> ResumePoint | None:  # this run's newest checkpoint, else the one it started from
        info = newest_checkpoint(str(ckpt.dir), since_s) or (find_checkpoint(ckpt.resume) if ckpt.resume else None)
        return (
            None
            if info is None
            else ResumePoint(checkpoint=str(info.path), step=info.step, saved_under=info.saved_under)
        )

    graph = model_inputs(plan.model, cluster_of(plan), precision=plan.precision, optimizer=plan.optimizer).graph
    DEFAULT_CACHE.get(plan.model)  # the model's cut analysis (an export) now, not during a recovery
    replans: list[Replan] = []
    fault, resume = options.fault, ckpt.resume
    if not set(local_ranks(plan)[1]) <= watch.devices():  # the plan needs a device that is not there now
        why = _Stop(at_s=since_s, reason=ReplanReason.CLUSTER_CHANGED, detail="the plan's devices are not all there")
        plan = _replan(plan, resume_point(), watch, why, cfg, graph, replans, note)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sighup(watch))
        out_dir = options.output.out_dir
        root = Path(out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="heterog-elastic-")))
        for k in range(cfg.max_replans + 1):
            folder = root / f"launch{k}"
            cluster, devices = local_ranks(plan)
            launch = _Launch(watch, frozenset(d.name for d in cluster.devices), newest, folder, len(devices))
            opts = dataclasses.replace(
                options,
                fault=fault,
                checkpoint=dataclasses.replace(ckpt, resume=resume),
                output=dataclasses.replace(options.output, out_dir=str(folder)),
            )
            try:
                result = _alone(plan, opts, None if replans else inputs, stop=launch)  # inputs: the first plan's
            except (RankError, RunStopped) as e:
                _recovered(replans, launch)
                stop = _stopped(e, launch, plan, watch)
            else:
                _recovered(replans, launch)
                return dataclasses.replace(result, replans=tuple(replans))
            if k == cfg.max_replans:
                break
            fault = None  # a test's fault hits the first launch only
            point = resume_point()
            plan = _replan(plan, point, watch, stop, cfg, graph, replans, note)
            resume = point.checkpoint if point is not None else None
    raise ElasticError(f"the run stopped {cfg.max_replans + 1} times; giving up (ElasticConfig.max_replans).")


def _replan(
    plan: Plan,
    point: ResumePoint | None,
    watch: DeviceWatch,
    stop: _Stop,
    cfg: ElasticConfig,
    graph: OpGraph,
    replans: list[Replan],
    note: Callable[[str], None],
) -> Plan:
    """The plan for the devices there are now, recorded with the checkpoint the run goes on
    from (`point`; None: from the start)."""
    watch.poll()
    cluster = watch.available()
    old = _summary(plan)
    note(f"{stop.reason}: {stop.detail}; re-planning for {len(cluster.devices)} device(s) …")
    t0 = time.perf_counter()
    new_plan = replan(plan, cluster, cfg.replan_budget_s, graph=graph)
    replan_s = time.perf_counter() - t0
    new = _summary(new_plan)
    record = Replan(
        at_s=stop.at_s,
        reason=stop.reason,
        detail=stop.detail,
        lost=tuple(sorted(watch.lost)),
        added=tuple(d for d in new.cluster_devices if d not in old.cluster_devices),
        old=old,
        new=new,
        replan_s=replan_s,
        search_budget_s=cfg.replan_budget_s,
        resumed_from=point,
    )
    replans.append(record)
    note(record.describe())
    return new_plan


def _recovered(replans: list[Replan], launch: _Launch) -> None:
    """The last re-plan's time to recover, once its launch completed a step."""
    if replans and replans[-1].recovery_s is None and launch.first_step_at_s is not None:
        replans[-1] = dataclasses.replace(replans[-1], recovery_s=launch.first_step_at_s - replans[-1].at_s)
