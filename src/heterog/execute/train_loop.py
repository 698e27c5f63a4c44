"""The training options in a rank's loop (worker.py calls these hooks): one optimizer step
over `--accumulate` batches, its metrics, and the evaluations.

Accumulation: optimizer step k trains on the global batches k·N … k·N + N − 1 (N =
--accumulate; user data is read in that order). The first N − 1 run the Program's computes
and transfers only (runtime.StepMode.ACCUMULATE: autograd adds the gradients up, as
torch's DDP does under no_sync), the last runs it whole — syncs, clipping, the update — and
every loss is weighted 1/N, so the step equals one of a batch N times larger whose loss is
the mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from heterog.execute.clipping import GradientNorm
from heterog.execute.evaluation import eval_batches, evaluate
from heterog.execute.metrics import MetricsLog, tokens_in
from heterog.execute.runtime import Interpreter
from heterog.execute.step_modes import StepMode
from heterog.ir.plan import Plan, user_model_file
from heterog.ir.training_config import TrainingConfig
from heterog.training import Recipe, UserTraining, advance, current_lr
from heterog.workload import Workload, global_batch


def recipe_of(config: TrainingConfig, plan: Plan, steps: int) -> Recipe:
    """The run's optimizer recipe: the plan's kind, the run's training options and the
    functions of the user's model file; `steps`: the run's optimizer steps."""
    return Recipe(kind=plan.optimizer, config=config, user=UserTraining.of_model(plan.model.name), steps=steps)


class StepFigures(NamedTuple):
    """A step's training figures for its record."""

    lr: float | None  # the learning rate the step used
    grad_norm: float | None  # the global gradient norm before clipping, when measured


def needs_norm(config: TrainingConfig) -> bool:
    """Whether steps measure the global gradient norm (to clip it, or to log it)."""
    return config.clips or config.log_dir is not None


def gradient_norm(
    config: TrainingConfig, sync: Any, named: list, device: torch.device, host_staging: bool, only: set | None = None
):
    """The rank's part of the global gradient norm, when the options need it; `only`: count
    just these parameters (a tensor-parallel member after the first: its slices)."""
    return GradientNorm(sync, named, device, host_staging, only=only) if needs_norm(config) else None


@dataclass(kw_only=True)
class TrainingHooks:
    """The loop's side of the training options for one rank (module docstring)."""

    recipe: Recipe
    rank: int
    seed: int
    eval_loader: str | None = None  # 'file.py:eval_loader' of the user's model file
    log: MetricsLog | None = None
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    _held_out: list | None = None
    _lr: float | None = None  # the learning rate of the step under way

    @property
    def config(self) -> TrainingConfig:
        return self.recipe.config

    @staticmethod
    def start(recipe: Recipe, *, rank: int, seed: int, model_name: str) -> TrainingHooks:

        user = user_model_file(model_name)
        hooks = TrainingHooks(
            recipe=recipe,
            rank=rank,
            seed=seed,
            eval_loader=f"{user[0]}:eval_loader" if user and recipe.user.eval_loader else None,
        )
        if rank == 0 and recipe.config.log_dir:
            hooks.log = MetricsLog(recipe.config.log_dir, recipe.describe())
        return hooks

    def resumed(self, ex: Interpreter, first_step: int) -> None:
        """A resumed run: every schedule moved on to the checkpoint's step."""
        for sched in [ex.scheduler, *ex.sync.runner.schedulers]:
            advance(sched, first_step)

    def batches(self, work: Workload, batch_size: int, step: int) -> list:
        """The global batches of optimizer step `step`, on the host: each compute copies the
        samples it reads onto the rank's device (workload.own_slice), not the whole batch."""
        n = self.config.accumulate
        return [global_batch(work, batch_size, seed=self.seed, step=step * n + j) for j in range(n)]

    def train(self, ex: Interpreter, batches: list) -> float:
        """One optimizer step over the batches; this rank's share of the mean loss."""
        self._lr = current_lr(ex.optimizer) if ex.optimizer is not None else _server_lr(ex)  # the step's rate
        n, loss = len(batches), 0.0
        for j, (inputs, targets) in enumerate(batches):
            mode = StepMode.TRAIN if j == n - 1 else StepMode.ACCUMULATE
            loss = ex.step(inputs, targets, mode=mode, new_step=j == 0, loss_weight=1.0 / n)
        return loss

    def after(
        self, ex: Interpreter, *, step: int, step_time_s: float, batches: list, batch_size: int, work: Workload
    ) -> StepFigures:
        """The step's training figures for its record (learning rate, gradient norm), its
        metrics line, and an evaluation when one is due (kept in `evaluations`)."""
        lr = self._lr
        norm = ex.last_norm
        figures = StepFigures(lr=lr, grad_norm=norm.norm if norm is not None else None)
        if self.log is not None:
            tokens = tokens_in(batches[0][0])
            samples = batch_size * len(batches)
            self.log.record(
                step + 1,
                {
                    "train/loss": norm.loss if norm is not None else None,
                    "train/lr": lr,
                    "train/grad_norm": figures.grad_norm,
                    "train/samples_per_s": samples / step_time_s if step_time_s > 0 else None,
                    "train/tokens_per_s": tokens * len(batches) / step_time_s if tokens and step_time_s > 0 else None,
                },
            )
        every = self.config.eval_every
        if every and (step + 1) % every == 0:
            self.evaluate(ex, step + 1, batch_size, work)
        return figures

    def evaluate(self, ex: Interpreter, done_steps: int, batch_size: int, work: Workload) -> dict[str, float]:
        if self._held_out is None:
            self._held_out = eval_batches(
                work, self.eval_loader, batch_size, seed=self.seed, count=self.config.eval_batches
            )
        metrics = evaluate(ex, self._held_out, self.recipe.user.evaluate)
        self.evaluations.append({"step": done_steps, **metrics})
        if self.log is not None:
            self.log.record(done_steps, metrics, kind="eval")
        return metrics

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _server_lr(ex: Interpreter) -> float | None:
    """A rank that only serves parameters: its servers' learning rate."""
    for server in ex.sync.runner.servers.values():
        if server.optimizer is not None:
            return current_lr(server.optimizer)
    return None
