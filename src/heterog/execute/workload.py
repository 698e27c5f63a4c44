"""What the executor trains: a model factory, synthetic batches and a loss, from a ModelSpec.

A plan names its model as a zoo name (helper A's `heterog.capture.zoo`) or as
'path/file.py:factory'. Every rank resolves the same spec, seeds torch identically and
builds the full model, so replicas start from the same parameters as the single-process
reference; the global batch of step k is drawn with seed (seed, k) on every rank, so the
ranks agree on it without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from heterog.errors import ModelError
from heterog.userfile import load_user_module
from heterog.ir.plan import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    example_batch: Callable[[int, int | None], tuple[tuple[Any, ...], Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    seq_len: int | None = None
    data_fn: Callable[[int, int], tuple[Any, Any]] | None = None  # user data: (batch_size, step)


def _from_zoo_like(name: str, entry: Any, args: dict[str, Any], seq_len: int | None) -> Workload:
    for attr in ("build", "example_batch", "loss"):
        if not callable(getattr(entry, attr, None)):
            raise ModelError(f"model {name!r}: the factory returned {type(entry).__name__}, which "
                             f"lacks .{attr}(); return a zoo-style entry with build(**args), "
                             f"example_batch(batch_size, seq_len) and loss(output, targets).")
    return Workload(name=name, build=lambda: entry.build(**args),
                    example_batch=lambda b, s: entry.example_batch(b, s, "cpu", **args),
                    loss=entry.loss, seq_len=seq_len)


def resolve_workload(model: ModelSpec) -> Workload:
    """The Workload a plan's ModelSpec names (zoo name or 'path/file.py:factory')."""
    from heterog.capture.zoo import get_zoo_model
    entry = get_zoo_model(model.name)
    seq_len = model.seq_len or getattr(entry, "default_seq_len", None)
    return _from_zoo_like(model.name, entry, dict(model.args), seq_len)


def with_data(work: Workload, data: str | None) -> Workload:
    """Replace the synthetic batches by the user's: 'path/file.py:fn' with fn(batch_size, step)
    returning the global batch (inputs tuple, targets) of that step. Every rank calls it, so
    it must return the same batch for the same step (read by index, or seed your sampler)."""
    if not data:
        return work
    path, _, attr = data.rpartition(":")
    if not path.endswith(".py") or not Path(path).is_file():
        raise ModelError(f"data {data!r}: give 'path/file.py:fn' naming an existing file.")
    module = load_user_module(path, what="data", spec=data)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelError(f"data {data!r}: {path} defines no callable {attr!r}.")
    return replace(work, data_fn=fn)


def global_batch(work: Workload, batch_size: int, *, seed: int, step: int) -> tuple[tuple[Any, ...], Any]:
    """The same global batch on every rank (and in the reference): synthetic, seeded by
    (seed, step), or the user's data for `step` (with_data)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed * 1_000_003 + step + 1)
        if work.data_fn is not None:
            inputs, targets = work.data_fn(batch_size, step)
        else:
            inputs, targets = work.example_batch(batch_size, work.seq_len)
    finally:
        torch.random.set_rng_state(state)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return inputs, targets


def build_model(work: Workload, *, seed: int) -> nn.Module:
    """The full model with the parameters every rank and the reference agree on."""
    torch.manual_seed(seed)
    model = work.build()
    model.train()
    return model


def slice_batch(value: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a batch-first tensor or a tuple/list/dict of them."""
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return type(value)(slice_batch(v, start, stop) for v in value)
    if isinstance(value, dict):
        return {k: slice_batch(v, start, stop) for k, v in value.items()}
    return value


# The optimizer recipe every rank and the reference share; plans name only the kind.
SGD_LR = 0.05
ADAMW_LR = 1e-3


def make_optimizer(params: list[nn.Parameter], kind: str) -> torch.optim.Optimizer | None:
    """A local optimizer over this rank's parameters (None when the rank holds none)."""
    if not params:
        return None
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=ADAMW_LR)
    raise ModelError(f"optimizer {kind!r} is not supported by the executor; use sgd or adamw.")
