"""What the executor trains: a model factory, synthetic batches and a loss, from a ModelSpec.

A plan names its model as a zoo name (helper A's `heterog.capture.zoo`) or as
'path/file.py:factory'. Every rank resolves the same spec, seeds torch identically and
builds the full model, so replicas start from the same parameters as the single-process
reference; the global batch of step k is drawn with seed (seed, k) on every rank, so the
ranks agree on it without communicating.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from heterog.capture.zoo import get_zoo_model
from heterog.errors import DataError, ModelError
from heterog.ir.plan import ModelSpec
from heterog.training import DEFAULT_LR, Recipe
from heterog.userfile import load_user_module


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
            raise ModelError(
                f"model {name!r}: the factory returned {type(entry).__name__}, which "
                f"lacks .{attr}(); return a zoo-style entry with build(**args), "
                f"example_batch(batch_size, seq_len) and loss(output, targets)."
            )
    return Workload(
        name=name,
        build=lambda: entry.build(**args),
        example_batch=lambda b, s: entry.example_batch(b, s, "cpu", **args),
        loss=entry.loss,
        seq_len=seq_len,
    )


def resolve_workload(model: ModelSpec) -> Workload:
    """The Workload a plan's ModelSpec names (zoo name or 'path/file.py:factory')."""
    entry = get_zoo_model(model.name)
    seq_len = model.seq_len or getattr(entry, "default_seq_len", None)
    return _from_zoo_like(model.name, entry, dict(model.args), seq_len)


class LoaderSteps:
    """A DataLoader-like iterable read by step: batch k is the k-th item, over epochs.

    Every rank (and a resumed run) must see the same batch at step k, so the iterator of
    epoch e is created under torch seed LOADER_SEED + e (a DataLoader with shuffle=True draws
    its order then) and a resumed run skips the steps already done. Randomness drawn per
    item in the main process (not from the iterator's creation) is not covered.
    """

    def __init__(self, loader: Any, spec: str):
        self.loader, self.spec = loader, spec
        self._restart()

    def _restart(self) -> None:
        self.epoch, self.next_step, self.in_epoch = 0, 0, 0
        self.it = self._new_iterator()

    def _new_iterator(self):
        """The epoch's iterator, its first item already drawn under the epoch's seed (a
        DataLoader's RandomSampler draws its permutation at the first next(), not at iter())."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(LOADER_SEED + self.epoch)
            it = iter(self.loader)
            first = next(it, _END)
        return itertools.chain([] if first is _END else [first], it)

    def __call__(self, batch_size: int, step: int) -> Any:
        if step < self.next_step:
            self._restart()
        while True:
            try:
                item = next(self.it)
            except StopIteration:
                if self.in_epoch == 0:
                    raise DataError(f"--data {self.spec!r}: the loader yielded no batch.") from None
                self.epoch, self.in_epoch = self.epoch + 1, 0
                self.it = self._new_iterator()
                continue
            self.in_epoch += 1
            self.next_step += 1
            if self.next_step - 1 == step:
                return item


LOADER_SEED = 20_260_101
_END = object()


def with_data(work: Workload, data: str | None) -> Workload:
    """Replace the synthetic batches by the user's, 'path/file.py:name', either
      - a loader: name(batch_size) returns a DataLoader-like iterable of global batches
        (inputs, targets), read in order (LoaderSteps), or
      - a step function: name(batch_size, step) returns the global batch of that step.
    Every rank calls it, so it must give the same batch for the same step."""
    if not data:
        return work
    path, _, attr = data.rpartition(":")
    if not path.endswith(".py") or not attr:
        raise DataError(f"--data {data!r}: give 'path/file.py:loader' (a .py file, a colon, a function name).")
    if not Path(path).is_file():
        raise DataError(f"--data {data!r}: no file {path!r}.")
    module = load_user_module(path, what="data", spec=data)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise DataError(f"--data {data!r}: {path} defines no function {attr!r}.")
    positional = [
        p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) >= 2:
        return replace(work, data_fn=fn)
    state: dict[str, Any] = {}

    def by_step(batch_size: int, step: int) -> tuple[Any, Any]:
        if "steps" not in state:
            made = fn(batch_size) if positional else fn()
            if not hasattr(made, "__iter__"):
                raise DataError(
                    f"--data {data!r}: {attr}() returned {type(made).__name__}, not an iterable "
                    f"of (inputs, targets) batches such as a torch DataLoader."
                )
            state["steps"] = LoaderSteps(made, data)
        return state["steps"](batch_size, step)

    return replace(work, data_fn=by_step)


def check_batch(work: Workload, batch_size: int, *, source: str) -> None:
    """Fetch step 0's batch in this process and check its form, so a bad loader is reported
    before any rank starts (as one paragraph, not a rank's traceback)."""
    try:
        inputs, targets = global_batch(work, batch_size, seed=0, step=0)
    except DataError as e:
        raise DataError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's loader failed: say where
        raise DataError(f"{source}: producing the first batch failed: {type(e).__name__}: {e}.") from None
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise DataError(f"{source}: the batch's inputs hold no tensor; yield (inputs, targets) with tensors.")
    if first.shape[0] != batch_size:
        raise DataError(
            f"{source}: a batch holds {first.shape[0]} samples but the plan's global batch is "
            f"{batch_size}; yield global batches of {batch_size} (e.g. DataLoader(batch_size="
            f"{batch_size}, drop_last=True)) or re-plan with --batch-size {first.shape[0]}."
        )


def global_batch(work: Workload, batch_size: int, *, seed: int, step: int) -> tuple[tuple[Any, ...], Any]:
    """The same global batch on every rank (and in the reference): synthetic, seeded by
    (seed, step), or the user's data for `step` (with_data)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed * 1_000_003 + step + 1)
        if work.data_fn is not None:
            item = work.data_fn(batch_size, step)
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise DataError(
                    f"user data at step {step}: expected a pair (inputs, targets), found "
                    f"{type(item).__name__}{'' if not isinstance(item, (tuple, list)) else f' of {len(item)}'}."
                )
            inputs, targets = item
        else:
            inputs, targets = work.example_batch(batch_size, work.seq_len)
    finally:
        torch.random.set_rng_state(state)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return inputs, targets


def to_device(value: Any, device: torch.device) -> Any:
    """Every tensor in a (nested) batch moved to `device` (a no-op on the CPU)."""
    if device.type == "cpu":
        return value
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, value)


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


def own_slice(value: Any, start: int, stop: int, device: torch.device) -> Any:
    """Samples [start, stop) of a batch copied onto `device` as storage of their own (a copy
    on the CPU too): a rank holds on its device only the samples an instruction computes, and
    an input autograd saves for backward does not keep the whole batch alive (the memory model
    counts a replica's share, not the global batch)."""
    return tree_map(
        lambda x: x.to(device, copy=True, non_blocking=True) if isinstance(x, torch.Tensor) else x,
        slice_batch(value, start, stop),
    )


# The optimizer every rank and the reference share without training options; plans name only
# the kind (heterog/training.py holds the recipe with the user's options).
SGD_LR = DEFAULT_LR["sgd"]
ADAMW_LR = DEFAULT_LR["adamw"]


def make_optimizer(params: list[nn.Parameter], kind: str) -> torch.optim.Optimizer | None:
    """A local optimizer over this rank's parameters (None when the rank holds none), with
    the kind's default hyperparameters (training.Recipe with no options)."""
    return Recipe(kind=kind).make_optimizer(params)
