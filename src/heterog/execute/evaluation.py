"""Evaluation under the run's own plan: forward-only steps of the same Program, every K steps.

`--eval-every K` runs, after every K-th optimizer step, `--eval-batches` held-out global
batches through the rank's forward instructions only (runtime.StepMode.EVALUATE: forward
computes and forward transfers, no autograd, no sync, no update), so evaluation sees exactly
the parameters every replica holds and needs no other layout. Where the model's output is
made, the loss and the user's `evaluate(outputs, targets)` (a scalar or {name: scalar}, a
mean over the samples given, as a loss is) are taken on each sample range and summed
weighted by its samples; the sums of all ranks (one all_gather) over the samples evaluated
are the means over the whole batches, as one process evaluating each batch whole would
find.

The held-out batches: the user file's `eval_loader(batch_size)` (an iterable of global
(inputs, targets) batches, read as `--data` loaders are; its first `--eval-batches`
batches), else synthetic batches drawn under a seed apart from training's (EVAL_SEED), else,
with `--data`, the loader's first batches.

The stages are training graphs (torch.export of the model in training mode): their dropout
calls carry train=True and their batch norms training=True. `eval_module` makes each stage a
twin as `model.eval()` would run it — dropout off, batch norm normalising with its running
statistics and not updating them — sharing the stage's parameters and buffers. Each replica
holds the running statistics of the samples it trained on (as under DDP without SyncBatchNorm),
so a batch-normalised model's evaluation differs between replicas by as much as those do. What
a graph changes in its buffers during evaluation anyway (the batch-norm counter) is put back
afterwards, so evaluating does not change training.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from heterog.errors import TrainingError
from heterog.execute.step_modes import StepMode
from heterog.workload import global_batch, with_data

EVAL_SEED = 7_777_777  # synthetic held-out batches: seed + EVAL_SEED

_DROPOUT = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default}
# aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
_BATCH_NORM, _BN_TRAINING = torch.ops.aten.batch_norm.default, 5


def eval_module(module: nn.Module) -> nn.Module:
    """A forward-only twin of a stage: dropout calls with train=False, batch norms with
    training=False (their running statistics); the same parameters and buffers (an
    fx.GraphModule over a copy of the graph). Other modules are switched to eval() in a
    shallow copy."""
    if not isinstance(module, fx.GraphModule):
        twin = copy.copy(module)
        twin.eval()
        return twin
    graph = copy.deepcopy(module.graph)
    changed = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _DROPOUT and len(node.args) >= 3:
            node.args = (*node.args[:2], False, *node.args[3:])
            changed = True
        elif node.op == "call_function" and node.target in _DROPOUT and "train" in node.kwargs:
            node.kwargs = {**node.kwargs, "train": False}
            changed = True
        elif node.op == "call_function" and node.target is _BATCH_NORM and len(node.args) > _BN_TRAINING:
            node.args = (*node.args[:_BN_TRAINING], False, *node.args[_BN_TRAINING + 1 :])
            changed = True
    if not changed:
        return module
    return fx.GraphModule(module, graph)


def eval_forward(ex: Any, si: int, args: list[Any]) -> Any:
    """Stage `si`'s forward in an evaluation step: its twin, without autograd."""
    module = ex.eval_modules.get(si)
    if module is None:
        module = ex.eval_modules[si] = eval_module(ex.flow.stages[si].module)
    with ex.rank_device.autocast(ex.precision), torch.no_grad():
        return ex.call_stage(module, *args)  # not paced: evaluation time is not measured


def take_metrics(ex: Any, y: Any, target: Any, samples: int) -> None:
    """Where the model's output is made: the loss and the user's metrics on these samples,
    summed into `ex.eval_sums` weighted by their count (`evaluate` turns the sums into means)."""
    with ex.rank_device.autocast(ex.precision), torch.no_grad():
        found = {"loss": ex.work.loss(y, target)}
        if ex.evaluate_fn is not None:
            found.update(metrics_of(ex.evaluate_fn(y, target), source="evaluate(outputs, targets)"))
    for name, value in found.items():
        ex.eval_sums[name] = ex.eval_sums.get(name, 0.0) + float(value) * samples
    ex.eval_sums["samples"] = ex.eval_sums.get("samples", 0.0) + samples


def metrics_of(value: Any, *, source: str) -> dict[str, float]:
    """The user's evaluate() result as {name: float}: a scalar is 'metric'."""
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = [("metric", value)]
    out = {}
    for name, v in items:
        try:
            out[f"{name}"] = float(v.detach().float() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError, RuntimeError):
            raise TrainingError(
                f"{source} returned {type(v).__name__} for {name!r}; return a scalar (a float or a "
                f"one-element tensor) or a dict of them."
            ) from None
        if name in ("loss", "samples"):
            raise TrainingError(f"{source}: the name {name!r} is the run's own; call the metric otherwise.")
    return out


def eval_batches(work: Any, user_loader: str | None, batch_size: int, *, seed: int, count: int) -> list:
    """The held-out global batches (module docstring), in order."""

    if user_loader is not None:
        held_out = with_data(work, user_loader)
        return [global_batch(held_out, batch_size, seed=seed, step=i) for i in range(count)]
    return [global_batch(work, batch_size, seed=seed + EVAL_SEED, step=i) for i in range(count)]


def _buffers(ex: Any) -> list[torch.Tensor]:
    return [b for st in ex.flow.stages for b in st.module.buffers()]


def evaluate(ex: Any, batches: list, evaluate_fn: Any) -> dict[str, float]:
    """Run the batches forward-only through the interpreter `ex` (every rank at once) and
    return the metrics' means over their samples (the same on every rank)."""
    saved = [b.detach().clone() for b in _buffers(ex)]
    ex.eval_sums, ex.evaluate_fn = {}, evaluate_fn
    with ex.aside():
        try:
            for inputs, targets in batches:
                ex.step(inputs, targets, mode=StepMode.EVALUATE)  # on the host: computes copy their samples
        finally:
            with torch.no_grad():
                for buf, kept in zip(_buffers(ex), saved):
                    buf.copy_(kept)
    gathered: list[dict[str, float]] = [{}] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, ex.eval_sums)
    else:
        gathered = [ex.eval_sums]
    total: dict[str, float] = {}
    for sums in gathered:
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    samples = total.pop("samples", 0.0)
    return {f"eval/{k}": v / samples for k, v in sorted(total.items())} if samples else {}
