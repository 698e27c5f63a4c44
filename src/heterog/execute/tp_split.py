"""A transformer split Megatron-style for one member of a tensor-parallel set.

Each block has two split regions (cost/tensor_parallel.py describes them on the graph): the
attention (query/key/value column-parallel, divided by heads; the output projection
row-parallel) and the MLP (the first linear(s) column-parallel, divided by hidden units; the
last row-parallel). Member i of t keeps its rows of heads or hidden units of every column
linear (bias sliced alike) and its columns of the row linear, whose bias is added once, after
the sum. Megatron's f (`tp_ops.tp_copy`) follows the norm that feeds a region — in pre-norm
blocks the norm's output is read by the region's column linears alone, so one all-reduce of
the gradient serves them all — and g (`tp_ops.tp_reduce`) ends the row linear.

The operators go inside leaf modules (the norm's and the row linear's forward), never into a
parent's own code: the cut maps graph nodes to the capture's by leaf module and by the runs of
ops a parent performs itself (cut/split_export.py), and an op added to a parent would shift
those runs. The attention reads its head count from its tensors (`view(..., -1, head_dim)`),
so only GPT-2's `split_size` (the width of q, k and v in the fused `c_attn`) is changed.

Families, by the names of a block's children (module-level; `tests/test_tp_split.py` checks it
pairs the linears as `megatron_layout` does on the captured graph):
- GPT-2 (`ln_1`, `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp.c_fc`, `mlp.c_proj`; Conv1D
  weights are (in, out), `c_attn` fuses q, k, v),
- Llama and its relatives (Mistral, Qwen2: `input_layernorm`, `self_attn.{q,k,v,o}_proj`,
  `post_attention_layernorm`, `mlp.{gate,up,down}_proj`; nn.Linear weights are (out, in)),
- OPT (`self_attn_layer_norm`, `self_attn.{q,k,v,out}_proj`, `final_layer_norm`, `fc1`, `fc2`),
- BERT (`attention.self.{query,key,value}`, `attention.output.dense`, `intermediate.dense`,
  `output.dense`): post-norm, so f stands before each column linear instead (the norm's
  output also feeds the residual, whose gradient every member holds whole).
A model without such blocks is refused with the reason. The vocabulary embedding and the
output head stay whole on every member (Megatron splits them by vocabulary; the cost model is
told: `cost/tensor_parallel.py` `vocab_parallel=False`).

Every split parameter keeps its name and records how it was cut (`ParameterSlice`), so a
checkpoint writes it whole (gathered from the members) and a run of another degree reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from heterog.errors import PlanError
from heterog.execute.tp_ops import tp_copy, tp_reduce


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelRank:
    """This rank's place in its tensor-parallel set: member `index` of `degree`, its process
    group registered as `group` (tp_ops.register_group)."""

    index: int
    degree: int
    group: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterSlice:
    """How a parameter is cut: along `dim` (full size `full`), in `parts` equal segments (GPT-2's
    fused q, k, v: 3) each divided evenly among the members."""

    dim: int
    full: int
    parts: int = 1

    def ranges(self, index: int, degree: int) -> list[tuple[int, int]]:
        seg = self.full // self.parts
        width = seg // degree
        return [(j * seg + index * width, j * seg + (index + 1) * width) for j in range(self.parts)]

    def take(self, whole: Tensor, index: int, degree: int) -> Tensor:
        """Member `index`'s slice of the whole parameter (or of a tensor shaped like it)."""
        return torch.cat([whole.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges(index, degree)], self.dim)

    def assemble(self, slices: list[Tensor]) -> Tensor:
        """The whole parameter from every member's slice, in member order."""
        per_member = [s.chunk(self.parts, self.dim) for s in slices]
        return torch.cat([m[j] for j in range(self.parts) for m in per_member], self.dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Region:
    norm: str  # the module whose output feeds the columns alone (f after it); "" for post-norm blocks
    columns: tuple[str, ...]
    row: str  # g after it
    fused: int  # segments of each column's output (GPT-2's c_attn: q, k, v)
    heads: int  # units the columns are divided by (heads; hidden units for an MLP)
    kv_heads: int = 0  # Llama's key/value heads (k_proj, v_proj), when fewer than heads
    attention: str = ""  # the attention module, whose widths may need setting


def _child(module: nn.Module, path: str) -> Any:
    """The sub-module at `path`, or None (typed Any: families read their own attributes)."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _gpt2_regions(path: str, block: nn.Module) -> list[_Region] | None:
    if not all(
        _child(block, n) is not None for n in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    ):
        return None
    attn, mlp = _child(block, "attn"), _child(block, "mlp")
    if getattr(attn, "is_cross_attention", False):
        return None
    p = f"{path}." if path else ""
    return [
        _Region(
            norm=f"{p}ln_1", columns=(f"{p}attn.c_attn",), row=f"{p}attn.c_proj", fused=3,
            heads=int(attn.num_heads), attention=f"{p}attn",
        ),
        _Region(norm=f"{p}ln_2", columns=(f"{p}mlp.c_fc",), row=f"{p}mlp.c_proj", fused=1, heads=int(mlp.c_fc.nf)),
    ]  # fmt: skip


def _llama_regions(path: str, block: nn.Module) -> list[_Region] | None:
    names = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
    if not all(_child(block, n) is not None for n in names):
        return None
    p = f"{path}." if path else ""
    attn, mlp = _child(block, "self_attn"), _child(block, "mlp")
    head_dim = int(attn.head_dim)
    return [
        _Region(
            norm=f"{p}input_layernorm",
            columns=(f"{p}self_attn.q_proj", f"{p}self_attn.k_proj", f"{p}self_attn.v_proj"),
            row=f"{p}self_attn.o_proj",
            fused=1,
            heads=int(attn.q_proj.out_features) // head_dim,
            kv_heads=int(attn.k_proj.out_features) // head_dim,
            attention=f"{p}self_attn",
        ),
        _Region(
            norm=f"{p}post_attention_layernorm",
            columns=(f"{p}mlp.gate_proj", f"{p}mlp.up_proj"),
            row=f"{p}mlp.down_proj",
            fused=1,
            heads=int(mlp.gate_proj.out_features),
        ),
    ]


def _mlp(norm: str, column: str, row: str, hidden: int) -> _Region:
    """An MLP's region: one column linear of `hidden` units, then the row linear."""
    return _Region(norm=norm, columns=(column,), row=row, fused=1, heads=hidden)


def _opt_regions(path: str, block: nn.Module) -> list[_Region] | None:
    """OPT: pre-norm unless `do_layer_norm_before` is off (then f before each column linear);
    its attention reads `num_heads` (set to the slice's)."""
    names = ("self_attn_layer_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.out_proj", "final_layer_norm", "fc1", "fc2")  # fmt: skip
    if not all(_child(block, n) is not None for n in names):
        return None
    p = f"{path}." if path else ""
    attn, pre = _child(block, "self_attn"), bool(getattr(block, "do_layer_norm_before", True))
    return [
        _Region(
            norm=f"{p}self_attn_layer_norm" if pre else "",
            columns=(f"{p}self_attn.q_proj", f"{p}self_attn.k_proj", f"{p}self_attn.v_proj"),
            row=f"{p}self_attn.out_proj",
            fused=1,
            heads=int(attn.num_heads),
            attention=f"{p}self_attn",
        ),
        _mlp(f"{p}final_layer_norm" if pre else "", f"{p}fc1", f"{p}fc2", int(_child(block, "fc1").out_features)),
    ]


def _bert_regions(path: str, block: nn.Module) -> list[_Region] | None:
    """A post-norm block: the norm before a region also feeds its residual path, so f stands
    before each column linear (their input gradients are summed over the set one by one)."""
    names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense")  # fmt: skip
    if not all(_child(block, n) is not None for n in names):
        return None
    p = f"{path}." if path else ""
    attn = _child(block, "attention.self")
    return [
        _Region(
            norm="",
            columns=(f"{p}attention.self.query", f"{p}attention.self.key", f"{p}attention.self.value"),
            row=f"{p}attention.output.dense",
            fused=1,
            heads=int(attn.num_attention_heads),
            attention=f"{p}attention.self",
        ),
        _mlp("", f"{p}intermediate.dense", f"{p}output.dense", int(_child(block, "intermediate.dense").out_features)),
    ]


_FAMILIES: tuple[Callable[[str, nn.Module], list[_Region] | None], ...] = (
    _gpt2_regions,
    _llama_regions,
    _opt_regions,
    _bert_regions,
)


def split_regions(model: nn.Module) -> list[_Region]:
    """Every block's two regions, in module order; a PlanError when the model has none."""
    out: list[_Region] = []
    for path, module in model.named_modules():
        for family in _FAMILIES:
            regions = family(path, module)
            if regions:
                out += regions
                break
    if not out:
        raise PlanError(
            f"the executor cannot split {type(model).__name__} by tensor parallelism: it finds no transformer "
            f"block of a known layout (GPT-2's ln_1/attn.c_attn/attn.c_proj/ln_2/mlp, Llama's "
            f"input_layernorm/self_attn.q,k,v,o_proj/post_attention_layernorm/mlp.gate,up,down_proj, or BERT's "
            f"attention.self.query,key,value/attention.output.dense/intermediate.dense/output.dense). "
            f"Plan it without tensor parallelism (--tp 1)."
        )
    return out


def region_pairs(model: nn.Module) -> list[tuple[str, tuple[str, ...], str]]:
    """(norm, column linears, row linear) of every region, by module name: what the split pairs
    (the capture names a leaf module's node by its module path)."""
    return [(r.norm, r.columns, r.row) for r in split_regions(model)]


Regions = tuple[tuple[str, tuple[str, ...], str], ...]  # (norm, column linears, row linear) by name


def split_model(model: nn.Module, tp: TensorParallelRank, regions: Regions | None = None) -> dict[str, ParameterSlice]:
    """Cut `model` in place to member `tp.index` of `tp.degree`; how each cut parameter was cut,
    by its name in the model. regions: split exactly these (the Program's `tp_regions`, what the
    cost model priced split: a block it left whole stays whole); None: every one found."""
    if tp.degree == 1:
        return {}
    found = split_regions(model)
    if regions is not None:
        wanted = {(c, r) for _, c, r in regions}
        missing = wanted - {(r.columns, r.row) for r in found}
        if missing:
            columns, row = sorted(missing)[0]
            raise PlanError(
                f"the plan splits the region from {columns[0]!r} to {row!r} by tensor parallelism, which the "
                f"executor does not find among {type(model).__name__}'s modules ({len(missing)} such region(s)); "
                f"plan it without tensor parallelism (--tp 1)."
            )
        norms = {(c, r): n for n, c, r in regions}
        # f after the norm only where the graph says that norm feeds the region; else before
        # each column linear, which is right whatever else reads the region's input
        found = [
            r if norms[(r.columns, r.row)] == r.norm else dataclasses.replace(r, norm="")
            for r in found
            if (r.columns, r.row) in wanted
        ]
    cut: dict[str, ParameterSlice] = {}
    for region in found:
        for units, what in ((region.heads, "heads"), (region.kv_heads, "key/value heads")):
            if units and units % tp.degree:
                raise PlanError(
                    f"{region.columns[0]!r} has {units} {what}, which tensor parallelism of degree {tp.degree} "
                    f"cannot divide evenly; choose a degree that divides {units}."
                )
        for name in region.columns:
            cut.update(_split_column(model, name, region.fused, tp))
        cut.update(_split_row(model, region.row, tp))
        if region.norm:
            _copy_after(model.get_submodule(region.norm), tp.group)
        else:
            for name in region.columns:
                _copy_before(model.get_submodule(name), tp.group)
        if region.attention:  # widths the attention reads from itself (GPT-2's fused split, OPT's heads)
            attn: Any = model.get_submodule(region.attention)
            if region.fused > 1:
                attn.split_size //= tp.degree
            if hasattr(attn, "num_heads"):
                attn.num_heads //= tp.degree
    return cut


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's Conv1D: a linear whose weight is (in, out), width in `nf`."""
    weight = getattr(m, "weight", None)
    return hasattr(m, "nf") and isinstance(weight, nn.Parameter) and weight.dim() == 2


def _set(m: nn.Module, attr: str, value: Tensor) -> None:
    """Cut a parameter in place: the Parameter object stays (placement and checkpoints keep it)."""
    getattr(m, attr).data = value.contiguous()


def _split_column(model: nn.Module, name: str, fused: int, tp: TensorParallelRank) -> dict[str, ParameterSlice]:
    m: Any = model.get_submodule(name)
    conv = _is_conv1d(m)
    dim = 1 if conv else 0  # output features
    out = {f"{name}.weight": ParameterSlice(dim=dim, full=m.weight.shape[dim], parts=fused)}
    if getattr(m, "bias", None) is not None:
        out[f"{name}.bias"] = ParameterSlice(dim=0, full=m.bias.shape[0], parts=fused)
    for attr, sl in out.items():
        _set(m, attr.rsplit(".", 1)[1], sl.take(getattr(m, attr.rsplit(".", 1)[1]).data, tp.index, tp.degree))
    if conv:
        m.nf = m.weight.shape[1]
    else:
        m.out_features = m.weight.shape[0]
    return out


def _split_row(model: nn.Module, name: str, tp: TensorParallelRank) -> dict[str, ParameterSlice]:
    m: Any = model.get_submodule(name)
    conv = _is_conv1d(m)
    dim = 0 if conv else 1  # input features
    sl = ParameterSlice(dim=dim, full=m.weight.shape[dim])
    _set(m, "weight", sl.take(m.weight.data, tp.index, tp.degree))
    group = tp.group
    if conv:

        def forward(x: Tensor) -> Tensor:
            y = tp_reduce(torch.mm(x.reshape(-1, x.size(-1)), m.weight), group) + m.bias
            return y.view(*x.shape[:-1], m.nf)

    else:
        m.in_features = m.weight.shape[1]

        def forward(x: Tensor) -> Tensor:
            y = tp_reduce(nn.functional.linear(x, m.weight), group)
            return y if m.bias is None else y + m.bias

    m.forward = forward
    return {f"{name}.weight": sl}


def _copy_before(linear: Any, group: str) -> None:
    inner = linear.forward

    def forward(x: Tensor) -> Tensor:
        return inner(tp_copy(x, group))

    linear.forward = forward


def _copy_after(norm: Any, group: str) -> None:
    inner = norm.forward

    def forward(*args, **kwargs):
        return tp_copy(inner(*args, **kwargs), group)

    norm.forward = forward
