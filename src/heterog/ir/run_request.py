"""What a training run of a plan is asked to do: RunOptions in small config objects, and the
RunRequest (a plan and its options) as a versioned artifact.

Each config object holds one concern and checks itself in `__post_init__`, with a message that
says how to fix the value (the option's CLI spelling where it has one):
  TrainingConfig    how the ranks train: the data they read, the optimizer's hyperparameters,
                    schedule, clipping, accumulation, evaluation (ir/training_config.py)
  CheckpointConfig  what a run saves, and the checkpoint it resumes from
  TimingConfig      steps left out of the timing, and how often the whole run is repeated
  PredictionConfig  whether the simulator's prediction goes beside the measurement, and from
                    what costs (analytic, or per-node times measured on this CPU first)
  DeviceLayout      where the ranks run: emulated with CPU processes, pinned cores, GPUs
                    shared through host copies, NCCL settings
  LinkConfig        whether an emulated cluster's links are shaped with netns + tc
  Limits            the timeout of every collective and transfer; starting despite memory
  OutputConfig      the folder the ranks write to, and their final parameters
  Fault             a test hook: a rank that dies, hangs or overflows at a step
`heterog run`'s options, `heterog.run(plan, …)`'s keywords and the ranks' spec
(execute/spec.py) all carry these objects, so an option is named and checked once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from heterog.errors import CheckpointError, PlanError
from heterog.ir.plan import Plan
from heterog.ir.provenance import SavedUnder
from heterog.ir.training_config import TrainingConfig
from heterog.jsonio import Artifact, Record, from_plain

KIND = "heterog.RunRequest"
SCHEMA_VERSION = 1


def _as_text(config: Any, *names: str) -> None:
    """Paths given as os.PathLike kept as text, so the config writes to JSON as it reads."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not isinstance(value, str):
            object.__setattr__(config, name, os.fspath(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig(Record):
    """What a run saves and where it starts. `resume` names a checkpoint directory (its last
    complete checkpoint is used) or one checkpoint folder."""

    dir: str | None = None
    every_steps: int = 0  # save after every N-th completed step; 0: never
    resume: str | None = None
    saved_under: SavedUnder | None = None  # the run's plan and cluster, for the markers (filled by the runner)

    def __post_init__(self) -> None:
        _as_text(self, "dir", "resume")
        if self.every_steps < 0:
            raise CheckpointError(f"--checkpoint-every must be ≥ 1 (or 0 for never), found {self.every_steps}.")
        if self.every_steps > 0 and not self.dir:
            raise CheckpointError("--checkpoint-every needs --checkpoint-dir DIR: where to write the checkpoints.")
        if self.dir and self.every_steps == 0:
            raise CheckpointError("--checkpoint-dir needs --checkpoint-every N (save every N steps).")

    @property
    def active(self) -> bool:
        return bool(self.dir or self.resume)

    def saves_after(self, completed_steps: int) -> bool:
        return self.every_steps > 0 and completed_steps % self.every_steps == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingConfig(Record):
    """warmup_steps: the first steps, left out of the measured iteration time (start-up,
    allocations); repetitions: how often the whole run is repeated (the result's time is the
    median of the repetitions', their spread says how noisy the machine was)."""

    warmup_steps: int = 1
    repetitions: int = 1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.repetitions < 1:
            raise PlanError(
                f"warm-up steps must be ≥ 0 and repetitions ≥ 1, found {self.warmup_steps} and {self.repetitions}."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictionConfig(Record):
    """predict: the simulator's prediction of the schedule that runs, beside the measurement
    (per step, rank and instruction); profile: predict from per-node times measured on this
    CPU first (one thread, as the ranks run; emulated clusters; a few seconds)."""

    predict: bool = True
    profile: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceLayout(Record):
    """Where the ranks run. emulated: a real GPU cluster's plan on local CPU processes, each
    device paced by its speed relative to the fastest; pin_cores: each rank on one core;
    share_gpus: with fewer GPUs than ranks, ranks share them through gloo with host copies
    (NCCL refuses two ranks on one GPU) — for checking a multi-rank plan on one GPU, not for
    speed; nccl: NCCL environment settings for every rank instead of the one algorithm and
    protocol chosen for unlike GPU types (execute/device.py nccl_env)."""

    emulated: bool = False
    pin_cores: bool = False
    share_gpus: bool = False
    nccl: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkConfig(Record):
    """shape: None shapes an emulated cluster's NIC bandwidths with netns + tc where this
    machine allows (root), True asks for it, False never does."""

    shape: bool | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits(Record):
    """timeout_s: of every collective and transfer, and of the start-up; force: start even
    when the plan's memory per rank exceeds this machine's free memory."""

    timeout_s: float = 60.0
    force: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise PlanError(f"the timeout must be > 0 s, found {self.timeout_s}.")


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputConfig(Record):
    """out_dir: keep the ranks' files here (logs, step lines, traces, the Program); without it
    a temporary folder is removed after the run. dump_params: each rank also writes its
    parameters after the last step and the instructions it executed (for tests)."""

    out_dir: str | None = None
    dump_params: bool = False

    def __post_init__(self) -> None:
        _as_text(self, "out_dir")


class FaultKind(StrEnum):
    DIE = "die"  # the rank exits at once
    HANG = "hang"  # the rank sleeps past every timeout
    OVERFLOW = "overflow"  # fp16: an inf in the rank's first gradient after the sync


class FaultPhase(StrEnum):
    START = "start"  # at the step's start
    MID = "mid"  # between backward and the gradient sync, while the peers wait


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault(Record):
    """A test hook for the robustness tests: rank `rank` fails at step `step`."""

    rank: int
    kind: FaultKind
    step: int
    phase: FaultPhase = FaultPhase.START

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        object.__setattr__(self, "phase", FaultPhase(self.phase))

    def hits(self, rank: int, step: int, phase: FaultPhase = FaultPhase.START) -> bool:
        return self.rank == rank and self.step == step and self.phase == phase


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions(Record):
    """Everything a run of a plan is asked, but the plan: `steps` training steps from `seed`
    (the same seed and global batch give the same losses under every plan), and one config
    object per concern (module docstring)."""

    steps: int = 5
    seed: int = 0
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    layout: DeviceLayout = field(default_factory=DeviceLayout)
    links: LinkConfig = field(default_factory=LinkConfig)
    limits: Limits = field(default_factory=Limits)
    output: OutputConfig = field(default_factory=OutputConfig)
    fault: Fault | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise PlanError(f"steps must be ≥ 1, found {self.steps}.")

    def with_(self, **fields: Any) -> RunOptions:
        """These options with some fields replaced (each a field of RunOptions: steps, seed,
        or a whole config object, e.g. layout=DeviceLayout(emulated=True))."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            names = ", ".join(f.name for f in dataclasses.fields(self))
            raise PlanError(
                f"unknown run option(s) {', '.join(unknown)}; RunOptions has {names} "
                f"(e.g. layout=DeviceLayout(emulated=True), timing=TimingConfig(warmup_steps=0))."
            )
        return dataclasses.replace(self, **fields)


@dataclass(frozen=True, kw_only=True)
class RunRequest(Artifact, kind=KIND, version=SCHEMA_VERSION):
    """A plan and what its run is asked: what `heterog.run` takes whole, and what a run
    result records of how it was made."""

    plan: Plan
    options: RunOptions = field(default_factory=RunOptions)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "options": self.options.to_dict()}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<run request>") -> RunRequest:
        if not isinstance(doc, dict) or "plan" not in doc:
            raise PlanError(f"{source}: a run request holds 'plan' and 'options'; write one with RunRequest.save.")
        return RunRequest(
            plan=Plan.from_dict(doc["plan"], f"{source}: plan"),
            options=from_plain(RunOptions, doc.get("options", {}), f"{source}: options"),
        )
