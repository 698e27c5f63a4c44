"""Per-aten-op FLOPs, memory traffic and op kind, from shapes only (works on fake tensors).

Matrix-class FLOPs (mm, conv, attention) come from torch.utils.flop_counter's formula registry
so we share its conventions (2 FLOPs per multiply-add; attention counted as dense, causal masks
not halved). We add what it lacks:

- the CPU fused-attention kernels ``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward, which the stock registry does not list (so a CPU/fake capture would count 0). We
  reuse the stock GQA-aware formulas: forward QK^T and PV, 2·2·b·h_q·s_q·s_k·d
  (Dao et al., FlashAttention, 2022, §3.2), backward the 5 batched products including the
  recomputed scores (2.5× forward). With grouped KV heads (h_kv < h_q) each query head still
  multiplies against its (shared) KV head, so FLOPs depend on h_q only; sharing saves memory,
  not arithmetic (Ainslie et al., GQA, 2023, §2).
- convolution backward: each of grad-input and grad-weight is a convolution over the same
  multiply-adds as the forward (2·N·C_out·(C_in/groups)·k·H_out·W_out), so each costs exactly
  the forward FLOPs. The stock formula builds grad-weight as a dense convolution and ignores
  `groups`, overcounting depthwise convolutions (MobileNet) by a factor of C.
- non-matrix ops, which the stock counter counts as 0: one FLOP per element of the larger of
  their inputs/outputs (pointwise math, reductions, norms, softmax). That is the usual
  roofline convention; those ops are memory-bound, so their time comes from bytes, not FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import conv_flop_count, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else t


def _cpu_flash_fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _cpu_flash_bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _conv_bwd(
    grad_out,
    x,
    w,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed,
    _out_pad,
    _groups,
    output_mask,
    *args,
    out_val=None,
    **kwargs,
) -> int:
    forward = conv_flop_count(_shape(x), _shape(w), _shape(grad_out), transposed=transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


# The stock registry plus our additions; a copy, so importing heterog changes nothing global.
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd,
    aten.convolution_backward: _conv_bwd,
}

_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "flex_attention")
_MATMUL = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "addmv",
    "mv",
    "dot",
    "matmul",
    "linear",
    "addbmm",
    "vdot",
    "_int_mm",
}
_EMBEDDING = {
    "embedding",
    "embedding_dense_backward",
    "embedding_backward",
    "_embedding_bag",
    "_embedding_bag_backward",
    "embedding_renorm_",
}
_LOSS = {
    "nll_loss",
    "nll_loss_forward",
    "nll_loss_backward",
    "nll_loss2d_forward",
    "nll_loss2d_backward",
    "mse_loss",
    "mse_loss_backward",
    "binary_cross_entropy",
    "binary_cross_entropy_backward",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "smooth_l1_loss_backward",
    "huber_loss",
    "huber_loss_backward",
    "l1_loss",
    "kl_div",
    "cross_entropy_loss",
}
_REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "logsumexp",
    "cumsum",
    "prod",
    "argmax",
    "argmin",
    "norm",
    "linalg_vector_norm",
    "any",
    "all",
    "topk",
    "sort",
}
# Ops that move or create data without arithmetic.
_MEMORY = {
    "copy_",
    "_to_copy",
    "clone",
    "cat",
    "stack",
    "index_select",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_add_",
    "index",
    "index_put",
    "index_put_",
    "_unsafe_index",
    "_unsafe_index_put",
    "index_add",
    "slice_scatter",
    "select_scatter",
    "as_strided_scatter",
    "constant_pad_nd",
    "repeat",
    "new_zeros",
    "new_empty",
    "new_empty_strided",
    "new_ones",
    "new_full",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "empty",
    "empty_like",
    "empty_strided",
    "full",
    "full_like",
    "fill_",
    "zero_",
    "arange",
    "tril",
    "triu",
    "masked_fill",
    "masked_fill_",
    "where",
    "flip",
    "roll",
    "contiguous",
    "_unsafe_view",
    "lift_fresh",
    "lift_fresh_copy",
    "detach",
    "alias",
    "repeat_interleave",
    "expand_copy",
    "bernoulli_",
    "bernoulli",
    "native_dropout",
    "native_dropout_backward",
    "rand",
    "rand_like",
    "randn",
    "randint",
    "uniform_",
    "normal_",
    "split_with_sizes_copy",
    "embedding_dense_backward_copy",
    "unfold_backward",
    "im2col",
    "col2im",
}


def op_name(func: Any) -> str:
    """Overload-packet name, e.g. 'addmm' for aten.addmm.default."""
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(packet)).split(".")[-1]


def is_view_op(func: Any) -> bool:
    """Views and pure metadata ops launch no kernel and move no bytes."""
    return bool(getattr(func, "is_view", False)) or op_name(func) in {
        "_unsafe_view",
        "alias",
        "detach",
        "lift_fresh",
        "_reshape_alias",
        "set_",
        "resize_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "_local_scalar_dense",
        "_fused_sdp_choice",
        "_has_compatible_shallow_copy_type",
        "is_same_size",
        "_version",
    }


def op_kind(func: Any) -> str:
    """Kind of one aten op, one of ir.opgraph.OP_KINDS."""
    name = op_name(func)
    if any(w in name for w in _ATTENTION_WORDS):
        return "attention"
    if "convolution" in name or name.startswith(("conv", "_slow_conv", "slow_conv", "mkldnn_conv")):
        return "conv"
    if name in _MATMUL:
        return "matmul"
    if name in _EMBEDDING:
        return "embedding"
    if name in _LOSS:
        return "loss"
    if "norm" in name and name not in ("norm", "linalg_vector_norm"):
        return "norm"
    if "pool" in name:
        return "pool"
    if name in _REDUCTION:
        return "reduction"
    if name in _MEMORY or is_view_op(func):
        return "memory"
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags:
        return "elementwise"
    return "other"


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, bool, int]:
    """(FLOPs, whether they are matrix-class FLOPs, bytes read + written) of one aten op."""
    if is_view_op(func):
        return 0.0, False, 0
    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    traffic = sum(tensor_nbytes(t) for t in ins) + sum(tensor_nbytes(t) for t in outs)
    formula = FLOP_FORMULAS.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out)), True, traffic
    kind = op_kind(func)
    if kind in ("memory", "embedding"):
        return 0.0, False, traffic
    elements = max([t.numel() for t in ins + outs if t.is_floating_point()], default=0)
    return float(elements), False, traffic
