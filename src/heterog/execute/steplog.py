"""Per-step records of a run: each rank appends one JSON line per step as it finishes it,
and the command line merges the ranks' lines into one line per step while the run goes on.

Files (in the run's folder): `steps_rank<R>.jsonl`, one `StepRecord` (ir/run_result.py) per
line. A line is written whole and flushed, so a reader that sees a line sees all of it; a
reader skips a last line without its newline (being written).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from heterog.ir.run_result import StepLine, StepRecord
from heterog.jsonio import write_atomic

STEPS_FILE = "steps_rank{rank}.jsonl"
TRACE_FILE = "trace_rank{rank}.json"


class StepLog:
    """A rank's step file, appended to one line per step."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.write_text("")

    def append(self, record: StepRecord) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")
            f.flush()


def read_records(path: Path) -> list[StepRecord]:
    """The complete lines of one rank's step file (none if it does not exist yet)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline may be half-written
    return [StepRecord.from_dict(json.loads(line)) for line in lines if line.strip()]


def merge(records: Iterable[StepRecord], world_size: int) -> list[StepLine]:
    """One StepLine per step that every one of the `world_size` ranks has finished, in order."""
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    out = []
    for step in sorted(by_step):
        recs = by_step[step]
        if len({r.rank for r in recs}) < world_size:
            continue
        slow = max(recs, key=lambda r: (r.step_time_s, -r.rank))
        out.append(
            StepLine(
                step=step,
                loss=sum(r.loss for r in recs),
                step_time_s=slow.step_time_s,
                slowest_rank=slow.rank,
                slowest_device=slow.device,
            )
        )
    return out


def read_run(folder: Path, world_size: int) -> list[StepLine]:
    """The merged step lines of a run folder, as far as every rank has got."""
    records = [r for rank in range(world_size) for r in read_records(Path(folder) / STEPS_FILE.format(rank=rank))]
    return merge(records, world_size)


def write_jsonl(path: Path, lines: Iterable[StepLine]) -> None:
    """The merged lines as JSON lines, written atomically."""
    write_atomic(path, "".join(json.dumps(line.to_dict()) + "\n" for line in lines))
