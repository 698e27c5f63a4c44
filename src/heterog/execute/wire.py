"""The shape and dtype of every value that crosses between blocks, known before step 1.

A receive must allocate its buffer before the data arrives. Asking the sender (a header per
transfer) costs a host synchronisation per receive on a GPU and is not how NCCL matches
messages; so every rank derives the same table instead (`wire_table`): it runs the split's
stages once on fake tensors (torch's FakeTensorMode: shapes and dtypes, no data, no memory)
on the rank's device type, under the plan's autocast, with a batch of `PROBE_SAMPLES` samples.
Autocast decides dtypes (a linear's output is bf16 under amp-bf16, a layer norm's is not on a
GPU), which the exported graph, traced without autocast, does not record. A crossing value is
batch-first (cut_rewrite.batch_first_across_cuts), so a transfer of samples [lo, hi) of
value v is a tensor of shape (hi − lo, *per_sample_shape[v]) and dtype dtype[v]; its
gradient has the same shape and dtype.

Ranks of one device type derive equal tables: the same model, split, precision and rules.
Parameters are read, never written (the fake mode copies them), and the random generators
are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from heterog.cut.dataflow import Dataflow
from heterog.errors import PlanError
from heterog.workload import slice_batch

PROBE_SAMPLES = 3  # a prime, so that no other dimension is mistaken for the batch


@dataclass(frozen=True, kw_only=True, slots=True)
class WireSpec:
    per_sample_shape: tuple[int, ...]
    dtype: torch.dtype

    def shape(self, samples: int) -> tuple[int, ...]:
        return (samples, *self.per_sample_shape)


def _fake(mode: FakeTensorMode, value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value).to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_fake(mode, v, device) for v in value)
    if isinstance(value, dict):
        return {k: _fake(mode, v, device) for k, v in value.items()}
    return value


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and plain tensor attributes (lifted constants), by attribute path."""
    out = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for path, owner in module.named_modules():
        for attr, value in vars(owner).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                out.append((f"{path}.{attr}" if path else attr, value))
    return out


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return mode.from_tensor(t).to(device)


def _value(values: dict[str, Any], flow: Dataflow, v: str) -> Any:
    if v in flow.projections:
        src, index = flow.projections[v]
        return values[src][index]
    return values[v]


def wire_table(
    flow: Dataflow, inputs: tuple[Any, ...], crossing: set[str], *, device: torch.device, autocast: Any
) -> dict[str, WireSpec]:
    """Per crossing value, its per-sample shape and dtype on `device` under `autocast` (a
    context manager: the rank's autocast for the plan's precision). `inputs`: a global batch
    (at least PROBE_SAMPLES samples); `crossing`: the value names that move between blocks."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), mode, autocast, torch.no_grad():
        for name, x in zip(flow.inputs, inputs):
            values[name] = _fake(mode, slice_batch(x, 0, PROBE_SAMPLES), device)
        for stage in flow.stages:
            # the stage's own tensors as fakes on `device` (a stage this rank does not run stays
            # where it is, and its parameters may already be freed: their shapes come from the flow)
            state = {name: _fake_like(mode, t, device) for name, t in _named_tensors(stage.module)}
            values[stage.value] = torch.func.functional_call(
                stage.module, state, tuple(_value(values, flow, v) for v in stage.args)
            )
    table: dict[str, WireSpec] = {}
    for v in sorted(crossing):
        t = _value(values, flow, v)
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != PROBE_SAMPLES:
            what = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise PlanError(
                f"value {v!r} crosses between blocks but is not batch-first ({what} for a "
                f"batch of {PROBE_SAMPLES}); merge its producer and consumer groups."
            )
        table[v] = WireSpec(per_sample_shape=tuple(int(d) for d in t.shape[1:]), dtype=t.dtype)
    return table
