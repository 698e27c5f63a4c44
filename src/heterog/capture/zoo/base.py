"""ZooModel: how to build a model, make a synthetic batch for it, and compute its loss."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterog.errors import ModelError


def classification_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; `.logits` of a Hugging Face output, flattened over tokens for LMs."""
    logits = getattr(output, "logits", output)
    if logits.dim() > 2:
        logits = logits.reshape(-1, logits.shape[-1])
        targets = targets.reshape(-1)
    return F.cross_entropy(logits, targets)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooModel:
    """One built-in model. `builder(**args)` makes the nn.Module; `batch_maker(batch_size,
    seq_len, device, **args)` returns (inputs tuple, targets)."""

    name: str
    family: str  # cnn | transformer | lm | small
    description: str
    builder: Callable[..., nn.Module]
    batch_maker: Callable[..., tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor] = classification_loss
    default_batch_size: int = 32
    default_seq_len: int | None = None  # None: the model takes no sequence (images, vectors)
    max_seq_len: int | None = None  # positions it takes at default arguments (a `positions` argument overrides)
    image_size: int | None = None
    reference_params: int | None = None  # published parameter count at default arguments
    reference_source: str = ""
    default_args: dict[str, Any] = field(default_factory=dict)

    def _check_args(self, args: dict[str, Any]) -> dict[str, Any]:
        params = inspect.signature(self.builder).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {**self.default_args, **args}
        accepted = list(params)
        unknown = sorted(set(args) - set(accepted))
        if unknown:
            raise ModelError(
                f"model {self.name!r} has no argument(s) {', '.join(unknown)}; it accepts "
                f"{', '.join(accepted) or 'no arguments'} (--model-arg key=value)."
            )
        return {**self.default_args, **args}

    def build(self, **args: Any) -> nn.Module:
        args = self._check_args(args)
        try:
            return self.builder(**args)
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001 - a bad argument value reaches the user as one paragraph
            raise ModelError(
                f"building model {self.name!r} with {args or 'default arguments'} "
                f"failed: {type(e).__name__}: {e}. Check the --model-arg values."
            ) from e

    def example_batch(
        self, batch_size: int, seq_len: int | None = None, device: Any = "cpu", **args: Any
    ) -> tuple[tuple[Any, ...], Any]:
        """Synthetic (inputs, targets); pass the same model args as build() when they change
        input shapes (e.g. mlp in_features, llama vocab)."""
        if batch_size <= 0:
            raise ModelError(f"model {self.name!r}: batch size must be positive, found {batch_size}.")
        if self.default_seq_len is not None:
            seq_len = seq_len or self.default_seq_len
            if seq_len <= 0:
                raise ModelError(f"model {self.name!r}: seq_len must be positive, found {seq_len}.")
        args = self._check_args(args)
        limit = args.get("positions", self.max_seq_len)
        if seq_len is not None and limit is not None and seq_len > limit:
            raise ModelError(
                f"model {self.name!r} takes at most {limit:,} positions, but --seq-len is {seq_len:,}; "
                f"use --seq-len {limit} or less"
                + (
                    " (or --model-arg positions=N)."
                    if "positions" in inspect.signature(self.builder).parameters
                    else "."
                )
            )
        return self.batch_maker(batch_size, seq_len, device, **args)

    def loss(self, output: Any, targets: Any) -> torch.Tensor:
        return self.loss_fn(output, targets)


def image_batch(image_size: int, num_classes: int = 1000) -> Callable[..., tuple[tuple[Any, ...], Any]]:
    def make(batch_size: int, seq_len: int | None, device: Any, **args: Any):
        size = args.get("image_size", image_size)
        classes = args.get("num_classes", num_classes)
        x = torch.randn(batch_size, 3, size, size, device=device)
        return (x,), torch.randint(0, classes, (batch_size,), device=device)

    return make


def sequence_length(seq_len: int | None) -> int:
    """`seq_len`, which a sequence model's batch needs (the zoo gives each its default)."""
    if seq_len is None:
        raise ModelError("a sequence model needs a sequence length: give --seq-len (seq_len in the API).")
    return seq_len


def token_batch(vocab_arg: str, default_vocab: int) -> Callable[..., tuple[tuple[Any, ...], Any]]:
    """Next-token / masked-token data: ids and targets of shape (batch, seq)."""

    def make(batch_size: int, seq_len: int | None, device: Any, **args: Any):
        seq_len = sequence_length(seq_len)
        vocab = args.get(vocab_arg, default_vocab)
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
        return (ids,), torch.randint(0, vocab, (batch_size, seq_len), device=device)

    return make
