"""`heterog run`'s training options (heterog/training.py TrainingConfig), declared once here."""

from __future__ import annotations

from typing import Any

import typer

LR = typer.Option(None, "--lr", help="Learning rate (default: 0.05 for sgd, 1e-3 for adamw).")
WEIGHT_DECAY = typer.Option(None, "--weight-decay", help="Weight decay (default: torch's: 0 for sgd, 0.01 for adamw).")
MOMENTUM = typer.Option(None, "--momentum", help="SGD momentum (sgd plans).")
BETAS = typer.Option(None, "--betas", help="AdamW betas as B1,B2, e.g. 0.9,0.95 (adamw plans).")
WARMUP_STEPS = typer.Option(0, "--warmup-steps", min=0, help="Linear learning-rate warm-up over this many steps.")
LR_SCHEDULE = typer.Option(
    "constant", "--lr-schedule", help="constant, cosine or linear (decaying to 0 at the last of --steps)."
)
MAX_GRAD_NORM = typer.Option(
    None, "--max-grad-norm", help="Clip gradients to this global norm over all ranks (clip_grad_norm_)."
)
ACCUMULATE = typer.Option(
    1, "--accumulate", min=1, help="Batches per optimizer step: a global batch N times the plan's."
)
EVAL_EVERY = typer.Option(
    0, "--eval-every", min=0, help="Evaluate forward-only under the plan every K steps (0: never)."
)
EVAL_BATCHES = typer.Option(4, "--eval-batches", min=1, help="Held-out batches per evaluation.")
LOG_DIR = typer.Option(
    None, "--log-dir", help="Write metrics here: metrics.jsonl and TensorBoard event files (tensorboard --logdir)."
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


def training_options(**given: Any) -> dict[str, Any] | None:
    """The options as TrainingConfig's dict (validated), or None when all are defaults."""

    given["betas"] = parse_betas(given.get("betas"))
    # torch loads only to run: `heterog --help` starts without it
    from heterog.training import TrainingConfig

    config = TrainingConfig(**given)
    return None if config == TrainingConfig() else config.to_dict()
