"""What inputs a model can take: its longest sequence and its vocabulary, read from the model.

A sequence longer than a model's learned position table (GPT-2's 1024 positions) fails only
inside a rank at run time, as an IndexError in an embedding; token ids at or past the
vocabulary do the same (or silently read another row on a GPU). Both are knowable from the
model built on the meta device, so `heterog plan` checks the sequence length before it
captures, and `heterog run` checks the first batch before any rank starts.

Where the limits are read, first found wins:
- the sequence: the model's config (Hugging Face and nanoGPT-style): `n_positions`,
  `max_position_embeddings` (for rotary models, the length the rotary table is built for),
  `n_ctx`, `max_seq_len`, `block_size`, `seq_length`; the model's own `max_seq_len` or
  `block_size`; a position-embedding table (an nn.Embedding named `wpe`, `pos_emb`,
  `position_embeddings`, ...: its rows); a precomputed rotary table (a buffer `freqs_cis`,
  `cos_cached`, `sin_cached`: its rows);
- the vocabulary: the config's `vocab_size`; the model's input embeddings
  (`get_input_embeddings()`); the first nn.Embedding that is not a position table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heterog.errors import DataError, ModelError

_SEQ_FIELDS = ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len", "block_size", "seq_length")
_POSITION_TABLES = ("wpe", "pos_emb", "pos_embed", "pos_embedding", "position_embeddings", "embed_positions")
_ROTARY_TABLES = ("freqs_cis", "cos_cached", "sin_cached")


@dataclass(frozen=True, kw_only=True, slots=True)
class InputLimits:
    """A model's longest sequence and vocabulary size (None: none found), and where each was read."""

    max_positions: int | None = None
    positions_from: str = ""
    vocab_size: int | None = None
    vocab_from: str = ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _sequence_limit(model: nn.Module) -> tuple[int | None, str]:
    config = getattr(model, "config", None)
    for owner, where in ((config, "config."), (model, "")):
        for name in _SEQ_FIELDS if owner is config else ("max_seq_len", "block_size"):
            if owner is not None and (n := _int(getattr(owner, name, None))) is not None:
                return n, f"{where}{name}"
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            return module.num_embeddings, f"the position table {name} ({module.num_embeddings} rows)"
    for name, buf in model.named_buffers():
        if name.rsplit(".", 1)[-1] in _ROTARY_TABLES and buf.dim() >= 1:
            return int(buf.shape[0]), f"the rotary table {name} ({int(buf.shape[0])} rows)"
    return None, ""


def _vocabulary(model: nn.Module) -> tuple[int | None, str]:
    config = getattr(model, "config", None)
    if (n := _int(getattr(config, "vocab_size", None))) is not None:
        return n, "config.vocab_size"
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings, "its input embeddings"
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] not in _POSITION_TABLES:
            return module.num_embeddings, f"the embedding {name} ({module.num_embeddings} rows)"
    return None, ""


def input_limits(model: nn.Module) -> InputLimits:
    """The limits read from `model` (module docstring); a meta-device model will do."""
    positions, positions_from = _sequence_limit(model)
    vocab, vocab_from = _vocabulary(model)
    return InputLimits(max_positions=positions, positions_from=positions_from, vocab_size=vocab, vocab_from=vocab_from)


def _raise_hint(model_name: str, arg: str | None) -> str:
    return f" (--model-arg {arg}=N builds {model_name} with more)" if arg else ""


def check_seq_len(limits: InputLimits, seq_len: int | None, *, model_name: str, positions_arg: str | None) -> None:
    """Refuse a sequence length past the model's limit, naming the limit."""
    if seq_len is None or limits.max_positions is None or seq_len <= limits.max_positions:
        return
    raise ModelError(
        f"--seq-len {seq_len} is longer than model {model_name!r} takes: its {limits.positions_from} is "
        f"{limits.max_positions}. Use --seq-len {limits.max_positions} or less, or a model built for longer "
        f"sequences{_raise_hint(model_name, positions_arg)}."
    )


def token_ids(inputs: tuple[Any, ...]) -> torch.Tensor | None:
    """The batch's token ids: its first input when that is an integer tensor of shape
    (batch, sequence); None for other inputs."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() != 2 or first.is_floating_point() or first.dtype == torch.bool:
        return None
    return first


def check_batch_inputs(limits: InputLimits, inputs: tuple[Any, ...], *, model_name: str, source: str) -> None:
    """Refuse a batch whose token ids fall outside the vocabulary, or whose sequence is longer
    than the model takes, naming the limit and where it was read."""
    ids = token_ids(inputs)
    if ids is None or ids.device.type == "meta" or ids.numel() == 0:
        return
    seq = int(ids.shape[1])
    if limits.max_positions is not None and seq > limits.max_positions:
        raise DataError(
            f"{source}: the batch's sequences hold {seq} tokens, but model {model_name!r} takes at most "
            f"{limits.max_positions} ({limits.positions_from}); cut the sequences to {limits.max_positions}."
        )
    if limits.vocab_size is None:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limits.vocab_size:
        bad = high if high >= limits.vocab_size else low
        raise DataError(
            f"{source}: the first batch holds token id {bad}, outside model {model_name!r}'s vocabulary of "
            f"{limits.vocab_size} ({limits.vocab_from}: ids 0..{limits.vocab_size - 1}). Tokenize with the "
            f"model's tokenizer, or build the model with a vocabulary of at least {high + 1}."
        )
