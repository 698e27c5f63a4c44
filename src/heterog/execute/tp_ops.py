"""Megatron's two tensor-parallel operators as torch custom ops (Shoeybi et al., "Megatron-LM",
2019, §3, the operators f and g of Fig. 3):

- `tp_copy` (f): identity in forward; in backward the gradient is summed over the group. It
  stands before the column-parallel linears: each member computes a slice of their outputs, so
  each holds only its part of the gradient of their common input.
- `tp_reduce` (g): the sum over the group in forward; identity in backward. It ends a
  row-parallel linear: each member holds a partial sum of the output.

Why custom ops (torch.library.custom_op) and not DTensor's `parallelize_module`: the executor
runs a model as torch.export graphs cut at the plan's groups (cut/split_export.py), and a
custom op stays one opaque node of the exported graph that runs eagerly with its autograd rule
(`register_autograd`), on gloo and NCCL alike; DTensor's Colwise/RowwiseParallel would put
DTensor subclasses into that graph, and Hugging Face GPT-2's fused Conv1D `c_attn` (query, key
and value in one weight, each to be split by heads) has no layout among its styles.

A process group cannot be an argument of a custom op; the group travels as a name, resolved in
this process's registry (`register_group`, filled by the rank before its model is split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_GROUPS: dict[str, dist.ProcessGroup] = {}
_TIMING: list = []  # [clock, marks]: when set (time_with), each all-reduce's start and end marks
NO_COMMUNICATION = "check"  # the group of `heterog check`, which runs computes without communication


def register_group(name: str, group: dist.ProcessGroup) -> None:
    """Make `group` known to the operators under `name` (every member registers it)."""
    _GROUPS[name] = group


def group_of(name: str) -> dist.ProcessGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(
            f"tensor-parallel group {name!r} is not registered in this process; the rank registers its "
            f"group (execute/tp_ops.register_group) before it runs a split model."
        ) from None


def time_with(clock, marks: list) -> None:
    """Mark every all-reduce's start and end with the rank's clock (execute/device.py Clock: CUDA
    events on a GPU, so the marks cost no synchronisation) into `marks`, read after the step."""
    _TIMING[:] = [clock, marks]


def _sum_over(x: Tensor, group: str) -> Tensor:
    out = x.contiguous().clone()
    if group != NO_COMMUNICATION:
        start = _TIMING[0].mark() if _TIMING else None
        dist.all_reduce(out, group=group_of(group))
        if _TIMING:
            _TIMING[1].append((start, _TIMING[0].mark()))
    return out


@torch.library.custom_op("heterog::tp_copy", mutates_args=())
def tp_copy(x: Tensor, group: str) -> Tensor:
    """Megatron's f: identity forward, gradient summed over `group` in backward."""
    return x.clone()


@torch.library.custom_op("heterog::tp_reduce", mutates_args=())
def tp_reduce(x: Tensor, group: str) -> Tensor:
    """Megatron's g: summed over `group` in forward, identity in backward."""
    return _sum_over(x, group)


@tp_copy.register_fake
def _copy_fake(x: Tensor, group: str) -> Tensor:
    return torch.empty_like(x)


@tp_reduce.register_fake
def _reduce_fake(x: Tensor, group: str) -> Tensor:
    return torch.empty_like(x)


def _keep_group(ctx, inputs, output) -> None:
    ctx.group = inputs[1]


def _copy_backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
    return tp_reduce(grad, ctx.group), None


def _reduce_backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
    return grad, None


tp_copy.register_autograd(_copy_backward, setup_context=_keep_group)
tp_reduce.register_autograd(_reduce_backward, setup_context=_keep_group)
