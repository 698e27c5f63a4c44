"""Training metrics where people look: JSON lines and TensorBoard event files (`--log-dir D`).

Rank 0 writes, after every optimizer step, one line to `D/metrics.jsonl` and the same
scalars to TensorBoard event files in D (torch.utils.tensorboard.SummaryWriter; `tensorboard
--logdir D` shows them):
- train/loss: the step's global-batch loss (summed over the ranks' shares, the mean over the
  accumulated batches), train/lr, train/grad_norm (before clipping, over every rank's
  parameters: clipping.py), train/samples_per_s and, for token inputs, train/tokens_per_s;
- eval/loss and eval/<metric> after each evaluation (evaluation.py).
The first line (kind "run") records what trained: the optimizer, its hyperparameters, the
schedule and the training options (training.Recipe.describe), so a run can be repeated.
Steps are counted from 1 (the number of optimizer steps done), TensorBoard's global step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from heterog.errors import TrainingError

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """The run's metrics in `log_dir` (rank 0 only)."""

    def __init__(self, log_dir: str | Path, run: dict[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # the tensorboard package is a dependency; a trimmed install lacks it
            raise TrainingError(
                f"--log-dir {log_dir}: TensorBoard's writer cannot be imported ({e}); pip install tensorboard."
            ) from None
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lines = open(self.dir / METRICS_FILE, "a")  # noqa: SIM115 - open for the run, closed in close()
        self._writer = SummaryWriter(log_dir=str(self.dir))
        self._line({"kind": "run", **run})
        self._writer.add_text("run", json.dumps(run, indent=1, default=str))

    def _line(self, doc: dict[str, Any]) -> None:
        self._lines.write(json.dumps(doc, default=str) + "\n")
        self._lines.flush()

    def record(self, step: int, scalars: Mapping[str, float | None], kind: str = "train") -> None:
        """One line, and each scalar as a TensorBoard scalar at `step`."""
        kept = {k: float(v) for k, v in scalars.items() if v is not None}
        self._line({"kind": kind, "step": step, **kept})
        for tag, value in kept.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        self._lines.close()


def read_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of a run's metrics file."""
    path = Path(log_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tokens_in(inputs: tuple[Any, ...]) -> int | None:
    """Tokens in a batch: the elements of its first input when that is integer ids of shape
    (batch, sequence, ...); None for other inputs (images, vectors)."""

    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() < 2 or first.is_floating_point() or first.dtype == torch.bool:
        return None
    return int(first.numel())
