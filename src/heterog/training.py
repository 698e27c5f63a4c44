"""How the user trains: optimizer, learning-rate schedule, clipping, accumulation, evaluation.

A run carries one `TrainingConfig` (ir/training_config.py: the `heterog run` flags --data,
--lr, --weight-decay, --momentum, --betas, --warmup-steps, --lr-schedule, --max-grad-norm,
--accumulate, --eval-every, --eval-batches, --log-dir; recorded in the run's request), and
a user model file may bring its own functions,
found by name beside its model factory (as `loss` is):
- `optimizer(params) -> torch.optim.Optimizer` over a list of parameters;
- `scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler`, stepped once per
  optimizer step;
- `evaluate(outputs, targets) -> scalar or {name: scalar}`, a mean over the samples given (as
  a loss is), and `eval_loader(batch_size)`, an iterable of held-out (inputs, targets) global
  batches (workload.with_data's loader form).

`Recipe` turns them into the one function every optimizer of a run is made by,
`Recipe.make_optimizer(params)`: a rank's local optimizer over the parameters it holds, a
parameter server's over the parameters it serves, a shard's over its pieces. Each gets its
own scheduler (`Recipe.make_scheduler`). Distributed training then equals single-process
training with the same optimizer as long as the optimizer acts on each parameter alone, as
every torch.optim optimizer but LBFGS does (LBFGS is refused); a user's parameter groups
that look at a parameter's shape (no weight decay for 1-D tensors) see the real shapes, on a
server too (collectives.ParameterServer keeps one tensor per parameter).

The built-in schedule is a LambdaLR multiplier of the base learning rate at optimizer step
t (0-based), with W warm-up steps and D = the run's steps:
  t < W: (t + 1) / (W + 1)  — linear warm-up, never 0 (torch's LinearLR with
  start_factor 1/(W+1)); then with p = (t − W) / (D − W): constant 1, cosine
  ½(1 + cos(π·p)) (CosineAnnealingLR's closed form, eta_min 0), or linear 1 − p.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from heterog.errors import TrainingError
from heterog.ir.plan import user_model_file
from heterog.ir.training_config import LRSchedule, TrainingConfig
from heterog.userfile import load_user_module

# The optimizer each plan's kind gets without flags (the plan's memory model counts its state:
# cost/memory.py OPTIMIZER_STATE_COPIES).
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}


@dataclass(frozen=True, kw_only=True, slots=True)
class UserTraining:
    """The training functions a user model file defines (None where it does not)."""

    source: str = ""  # the model file, for messages
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    evaluate: Callable[[Any, Any], Any] | None = None
    eval_loader: Callable[..., Any] | None = None

    @staticmethod
    def of_model(model_name: str) -> UserTraining:
        """The functions of the model's file ('path/file.py:factory'); none for a zoo model."""

        user = user_model_file(model_name)
        if user is None:
            return UserTraining()
        module = load_user_module(user[0], what="model", spec=model_name)
        return UserTraining.of_module(module, source=user[0])

    @staticmethod
    def of_module(module: ModuleType, *, source: str) -> UserTraining:
        found: dict[str, Any] = {}
        for name in ("optimizer", "scheduler", "evaluate", "eval_loader"):
            fn = getattr(module, name, None)
            if fn is not None and not callable(fn):
                raise TrainingError(f"{source}: {name} is a {type(fn).__name__}, not a function.")
            found[name] = fn
        return UserTraining(source=source, **found)

    def names(self) -> list[str]:
        return [n for n in ("optimizer", "scheduler", "evaluate", "eval_loader") if getattr(self, n) is not None]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The optimizer and schedule of a run: the plan's kind with the config's
    hyperparameters, or the user's functions. `steps`: the run's optimizer steps (the
    default horizon of a decaying schedule)."""

    kind: str
    config: TrainingConfig = field(default_factory=TrainingConfig)
    user: UserTraining = field(default_factory=UserTraining)
    steps: int = 1

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
        """An optimizer over `params` (None when there are none: a rank that holds nothing)."""
        if not params:
            return None
        if self.user.optimizer is not None:
            return self._user_optimizer(params)
        c = self.config
        if self.kind == "sgd":
            return torch.optim.SGD(
                params, lr=c.lr or DEFAULT_LR["sgd"], momentum=c.momentum or 0.0, weight_decay=c.weight_decay or 0.0
            )
        if self.kind == "adamw":
            extra: dict[str, Any] = {}
            if c.weight_decay is not None:
                extra["weight_decay"] = c.weight_decay
            if c.betas is not None:
                extra["betas"] = c.betas
            return torch.optim.AdamW(params, lr=c.lr or DEFAULT_LR["adamw"], **extra)
        raise TrainingError(f"optimizer {self.kind!r} is not supported by the executor; use sgd or adamw.")

    def _user_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        assert self.user.optimizer is not None
        where = f"{self.user.source}: optimizer(params)"
        try:
            opt = self.user.optimizer(params)
        except Exception as e:  # noqa: BLE001 - the user's code: say where it failed
            raise TrainingError(f"{where} failed: {type(e).__name__}: {e}.") from e
        if not isinstance(opt, torch.optim.Optimizer):
            raise TrainingError(f"{where} returned {type(opt).__name__}, not a torch.optim.Optimizer.")
        if isinstance(opt, torch.optim.LBFGS):
            raise TrainingError(
                f"{where} returned LBFGS, which couples all parameters in one closure; the executor "
                f"steps each rank's parameters apart. Use an optimizer that acts per parameter."
            )
        given = {id(p) for p in params}
        held = [p for g in opt.param_groups for p in g["params"]]
        if {id(p) for p in held} != given or len(held) != len(given):
            raise TrainingError(
                f"{where} must optimise exactly the parameters it is given (each once): the "
                f"executor calls it for each rank's and each parameter server's share of the model."
            )
        return opt

    def make_scheduler(self, opt: torch.optim.Optimizer | None) -> Any:
        """The optimizer's learning-rate scheduler, stepped once per optimizer step (None
        without an optimizer, or for a constant rate without warm-up)."""
        if opt is None:
            return None
        if self.user.scheduler is not None:
            where = f"{self.user.source}: scheduler(optimizer)"
            try:
                sched = self.user.scheduler(opt)
            except Exception as e:  # noqa: BLE001 - the user's code
                raise TrainingError(f"{where} failed: {type(e).__name__}: {e}.") from e
            if not callable(getattr(sched, "step", None)):
                raise TrainingError(f"{where} returned {type(sched).__name__}, which has no step().")
            return sched
        c = self.config
        if c.lr_schedule == LRSchedule.CONSTANT and not c.warmup_steps:
            return None
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(c, c.decay_steps or self.steps))

    def describe(self, params: list[nn.Parameter] | None = None) -> dict[str, Any]:
        """What trains, for the run's record: the optimizer's class and hyperparameters and
        the schedule, made over a stand-in parameter when none is given."""
        probe = params or [nn.Parameter(torch.zeros(2, 2))]
        opt = self.make_optimizer(probe)
        assert opt is not None
        sched = self.make_scheduler(opt)
        hyper = [  # the base rate (a scheduler has already scaled `lr` for step 0)
            {
                k: _plain(g.get("initial_lr", v) if k == "lr" else v)
                for k, v in g.items()
                if k not in ("params", "initial_lr")
            }
            for g in opt.param_groups
        ]
        return {
            "optimizer": type(opt).__name__,
            "optimizer_from": "model file" if self.user.optimizer else "flags",
            "param_groups": hyper,
            "scheduler": type(sched).__name__ if sched is not None else None,
            "scheduler_from": "model file" if self.user.scheduler else "flags",
            "model_file_functions": self.user.names(),
            **self.config.to_dict(),
        }


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


def lr_factor(config: TrainingConfig, decay_steps: int) -> Callable[[int], float]:
    """The built-in schedule's multiplier at optimizer step t (module docstring)."""
    warmup, kind = config.warmup_steps, config.lr_schedule
    span = max(decay_steps - warmup, 1)

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / (warmup + 1)
        p = min((t - warmup) / span, 1.0)
        if kind == LRSchedule.COSINE:
            return 0.5 * (1.0 + math.cos(math.pi * p))
        if kind == LRSchedule.LINEAR:
            return 1.0 - p
        return 1.0

    return factor


def advance(scheduler: Any, steps: int) -> None:
    """A resumed run: the schedule moved on to the checkpoint's step (no optimizer steps)."""
    if scheduler is None:
        return

    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()


def current_lr(opt: torch.optim.Optimizer | None) -> float | None:
    """The learning rate of the optimizer's first parameter group (what the step used)."""
    return float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None


def evaluate_signature_ok(fn: Callable[..., Any]) -> bool:
    """evaluate(outputs, targets): two positional parameters."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
