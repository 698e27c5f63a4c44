"""`heterog run`'s training options (ir/training_config.py TrainingConfig), declared once here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from heterog.ir.training_config import TrainingConfig

Lr = Annotated[float | None, typer.Option("--lr", help="Learning rate (default: 0.05 for sgd, 1e-3 for adamw).")]
WeightDecay = Annotated[
    float | None, typer.Option("--weight-decay", help="Weight decay (default: torch's: 0 for sgd, 0.01 for adamw).")
]
Momentum = Annotated[float | None, typer.Option("--momentum", help="SGD momentum (sgd plans).")]
Betas = Annotated[str | None, typer.Option("--betas", help="AdamW betas as B1,B2, e.g. 0.9,0.95 (adamw plans).")]
WarmupSteps = Annotated[
    int, typer.Option("--warmup-steps", min=0, help="Linear learning-rate warm-up over this many steps.")
]
Schedule = Annotated[
    str, typer.Option("--lr-schedule", help="constant, cosine or linear (decaying to 0 at the last of --steps).")
]
MaxGradNorm = Annotated[
    float | None,
    typer.Option("--max-grad-norm", help="Clip gradients to this global norm over all ranks (clip_grad_norm_)."),
]
Accumulate = Annotated[
    int, typer.Option("--accumulate", min=1, help="Batches per optimizer step: a global batch N times the plan's.")
]
EvalEvery = Annotated[
    int, typer.Option("--eval-every", min=0, help="Evaluate forward-only under the plan every K steps (0: never).")
]
EvalBatches = Annotated[int, typer.Option("--eval-batches", min=1, help="Held-out batches per evaluation.")]
LogDir = Annotated[
    Path | None,
    typer.Option(
        "--log-dir", help="Write metrics here: metrics.jsonl and TensorBoard event files (tensorboard --logdir)."
    ),
]

# the command's parameters that are TrainingConfig's fields, by the same names
FLAGS = (
    "data",
    "lr",
    "weight_decay",
    "momentum",
    "betas",
    "warmup_steps",
    "lr_schedule",
    "max_grad_norm",
    "accumulate",
    "eval_every",
    "eval_batches",
    "log_dir",
)


def parse_betas(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        msg = f"give two numbers B1,B2 (e.g. 0.9,0.95), found {text!r}."
        raise typer.BadParameter(msg, param_hint="--betas") from None
    return b1, b2


def training_options(params: dict[str, Any]) -> TrainingConfig:
    """The training options among a command's parsed parameters (click's Context.params),
    validated: each names its flag when it is out of range."""
    given = {name: params.get(name) for name in FLAGS if name in params}
    given["betas"] = parse_betas(given.get("betas"))
    return TrainingConfig(**{k: v for k, v in given.items() if v is not None})
