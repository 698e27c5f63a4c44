"""What the launcher hands a rank process, and what the process hands back: typed records
written as JSON files in the run's folder.

  RankSpec     one plan's rank (`spec_rank<R>.json`; under torchrun one spec for every rank,
               which takes its rank from torchrun's environment and its device from
               `node_devices`)
  LaunchSpec   a multi-plan launch (launcher.launch_local_many): the process's place in the
               launch and one PlanEntry per plan; `rank_spec(entry)` is that plan's RankSpec
  RankResult   a rank's measurements (`result_rank<R>.json`): per step a StepRecord, the
               spans it measured, its memory
  RankFailure  what stopped a rank (`error_rank<R>.json`), for the launcher to name the culprit
The Program travels as its document (lower/program.py) and is validated where it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from heterog.ir.run_request import CheckpointConfig, Fault
from heterog.ir.run_result import Span, StepRecord
from heterog.ir.training_config import TrainingConfig
from heterog.jsonio import Artifact, Record, write_atomic
from heterog.lower.program import Program

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RankSpec(Artifact, Record, kind="heterog.RankSpec", version=SCHEMA_VERSION):
    program: dict[str, Any]  # the Program's document
    devices: tuple[str, ...] = ()  # rank → device (a local launch)
    rank: int = 0  # this process's rank (a local launch)
    torchrun: bool = False  # rank from torchrun's environment, device from node_devices
    node_devices: tuple[tuple[str, ...], ...] = ()  # torchrun: each node's devices, in rank order
    steps: int
    seed: int = 0
    timeout_s: float = 60.0
    threads: int = 1  # torch threads: a rank is one (the cost model's `cpu` device)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slowdowns: dict[str, float] = field(default_factory=dict)  # device → compute slowdown (pacing)
    pin_cores: bool = False
    dump_params: bool = False
    fault: Fault | None = None
    cuda: bool = False  # ranks compute on GPUs (NCCL), else the CPU (gloo)
    cuda_indices: tuple[int, ...] = ()  # rank → its GPU's index here (default: rank r on cuda:r)
    host_staging: bool = False  # ranks share GPUs: gloo, tensors cross through the host
    gpu_types: dict[str, str] = field(default_factory=dict)  # device → the GPU type its rank must find
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    out_dir: str = "."

    def load_program(self) -> Program:
        return Program.from_dict(self.program, "the program of this run")

    def slowdown(self, device: str) -> float:
        return self.slowdowns.get(device, 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry(Record):
    """One plan of a multi-plan launch: rank r of the plan runs in process processes[r]."""

    index: int
    devices: tuple[str, ...]
    processes: tuple[int, ...]
    program: dict[str, Any]
    out_dir: str
    wait_s: float  # the longest the launch's processes wait for each other after the plan
    slowdowns: dict[str, float] = field(default_factory=dict)
    fault: Fault | None = None
    dump_params: bool = False
    training: TrainingConfig = field(default_factory=TrainingConfig)


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(Artifact, Record, kind="heterog.LaunchSpec", version=SCHEMA_VERSION):
    rank: int  # this process's place in the launch
    world: int  # processes in the launch
    steps: int
    seed: int = 0
    timeout_s: float = 60.0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    plans: tuple[PlanEntry, ...] = ()

    def rank_spec(self, entry: PlanEntry) -> RankSpec:
        """The spec of this process's rank in `entry`'s plan (it must be one of its processes)."""
        return RankSpec(
            program=entry.program,
            devices=entry.devices,
            rank=entry.processes.index(self.rank),
            steps=self.steps,
            seed=self.seed,
            timeout_s=self.timeout_s,
            training=entry.training,
            slowdowns=entry.slowdowns,
            fault=entry.fault,
            dump_params=entry.dump_params,
            master_addr=self.master_addr,
            master_port=self.master_port,
            out_dir=entry.out_dir,
        )


def read_spec(path: str | Path) -> RankSpec | LaunchSpec:
    """The spec file a rank process was started with (either kind)."""
    kind = json.loads(Path(path).read_text()).get("kind")
    return LaunchSpec.load(path) if kind == LaunchSpec.KIND else RankSpec.load(path)


@dataclass(frozen=True, kw_only=True)
class RankResult(Artifact, Record, kind="heterog.RankResult", version=SCHEMA_VERSION):
    """What one rank measured over its steps."""

    rank: int
    device: str
    slowdown: float
    cores: tuple[int, ...] | None
    groups: tuple[str, ...]  # the plan's groups this rank holds
    steps: tuple[StepRecord, ...]
    spans: tuple[Span, ...]
    sent_bytes: int
    max_rss_bytes: int
    torch_device: str = "cpu"
    backend: str = "gloo"
    host_staging: bool = False
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    memory_cap_bytes: int | None = None
    peak_live_bytes: int | None = None
    split: bool = True  # False: the model ran whole (one stage)
    warnings: tuple[str, ...] = ()
    training: dict[str, Any] | None = None  # rank 0: training.Recipe.describe(), what trained
    evaluations: tuple[dict[str, Any], ...] = ()  # {"step", "eval/loss", …} per evaluation

    @staticmethod
    def path(folder: Path, rank: int) -> Path:
        return Path(folder) / f"result_rank{rank}.json"


class FailureKind(StrEnum):
    TIMEOUT = "timeout"  # waited for a peer past the timeout
    PEER = "peer"  # a peer's connection broke: it died
    ERROR = "error"  # this rank's own error


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFailure(Record):
    """What stopped a rank, as it reports it."""

    rank: int
    kind: FailureKind
    type: str
    message: str
    traceback: str = ""

    @staticmethod
    def path(folder: Path, rank: int) -> Path:
        return Path(folder) / f"error_rank{rank}.json"

    def save(self, folder: Path) -> None:
        write_atomic(self.path(folder, self.rank), json.dumps(self.to_dict()))

    @staticmethod
    def read(folder: Path, rank: int) -> RankFailure | None:
        path = RankFailure.path(folder, rank)
        return RankFailure.from_dict(json.loads(path.read_text()), str(path)) if path.exists() else None
