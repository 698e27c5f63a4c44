"""The training options of a run (the `heterog run` flags --data, --lr, --weight-decay,
--momentum, --betas, --warmup-steps, --lr-schedule, --max-grad-norm, --accumulate,
--eval-every, --eval-batches, --log-dir) as one typed record.

It lives with the artifacts because a run request records it (ir/run_request.py RunOptions),
so that a run is reproducible from its request, and the ranks' spec carries it
(execute/spec.py). What the options do — the optimizer and schedule they make, the user's
model-file functions — is heterog/training.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, Protocol, Self

from heterog.errors import TrainingError
from heterog.jsonio import Record, from_plain


class LRSchedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class UserFunctions(Protocol):
    """What check_for reads of a model file's training functions (training.UserTraining)."""

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Any: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig(Record):
    """The training options of a run; None: the plan optimizer's default (torch's, and
    training.DEFAULT_LR for the learning rate). `data`: 'path/file.py:loader',
    loader(batch_size) → an iterable of global (inputs, targets) batches (workload.with_data);
    None: the model's synthetic batches. `decay_steps`: the horizon of a cosine or linear
    schedule, the run's --steps unless given."""

    data: str | None = None
    lr: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None  # sgd only
    betas: tuple[float, float] | None = None  # adamw only
    lr_schedule: LRSchedule = LRSchedule.CONSTANT
    warmup_steps: int = 0
    decay_steps: int | None = None
    max_grad_norm: float | None = None
    accumulate: int = 1
    eval_every: int = 0
    eval_batches: int = 4
    log_dir: str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, what: str, value: Any) -> None:
            if not ok:
                raise TrainingError(f"{flag} must be {what}, found {value!r}.")

        for name in ("data", "log_dir"):  # paths given as os.PathLike kept as text, for JSON
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, os.fspath(value))
        need(self.lr is None or self.lr > 0, "--lr", "a positive learning rate", self.lr)
        need(self.weight_decay is None or self.weight_decay >= 0, "--weight-decay", "≥ 0", self.weight_decay)
        need(self.momentum is None or 0 <= self.momentum < 1, "--momentum", "in [0, 1)", self.momentum)
        if self.betas is not None:
            object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
            need(
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                "--betas",
                "two numbers in [0, 1), e.g. 0.9,0.95",
                self.betas,
            )
        object.__setattr__(self, "lr_schedule", _schedule(self.lr_schedule))
        need(self.warmup_steps >= 0, "--warmup-steps", "≥ 0", self.warmup_steps)
        need(self.decay_steps is None or self.decay_steps >= 1, "decay_steps", "≥ 1", self.decay_steps)
        need(self.max_grad_norm is None or self.max_grad_norm > 0, "--max-grad-norm", "positive", self.max_grad_norm)
        need(self.accumulate >= 1, "--accumulate", "≥ 1 (batches per optimizer step)", self.accumulate)
        need(self.eval_every >= 0, "--eval-every", "≥ 0 (0: never)", self.eval_every)
        need(self.eval_batches >= 1, "--eval-batches", "≥ 1", self.eval_batches)

    @property
    def clips(self) -> bool:
        return self.max_grad_norm is not None

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None, source: str = "training options") -> Self:
        """The options of `doc` (None or empty: the defaults); a field it does not know is
        refused by name, not ignored."""
        if not doc:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise TrainingError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}.")
        return from_plain(cls, doc, source)

    def check_for(self, kind: str, user: UserFunctions) -> None:
        """Refuse flags that the plan's optimizer kind, or the user's own optimizer, ignore."""
        if user.optimizer is not None:
            given = [f for f, v in (("--lr", self.lr), ("--weight-decay", self.weight_decay)) if v is not None]
            given += [f for f, v in (("--momentum", self.momentum), ("--betas", self.betas)) if v is not None]
            if given:
                raise TrainingError(
                    f"{', '.join(given)}: the model file defines optimizer(params), which sets its own "
                    f"hyperparameters; change them there, or remove optimizer() to use the flags."
                )
        elif kind == "sgd" and self.betas is not None:
            raise TrainingError("--betas applies to adamw; the plan's optimizer is sgd (use --momentum).")
        elif kind == "adamw" and self.momentum is not None:
            raise TrainingError("--momentum applies to sgd; the plan's optimizer is adamw (use --betas).")
        if user.scheduler is not None and (self.lr_schedule != LRSchedule.CONSTANT or self.warmup_steps):
            raise TrainingError(
                "--lr-schedule/--warmup-steps: the model file defines scheduler(optimizer); "
                "change the schedule there, or remove scheduler() to use the flags."
            )


def _schedule(value: Any) -> LRSchedule:
    try:
        return LRSchedule(value)
    except ValueError:
        raise TrainingError(
            f"--lr-schedule must be one of {', '.join(s.value for s in LRSchedule)}, found {value!r}."
        ) from None
