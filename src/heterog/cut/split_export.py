"""A model as one aten graph whose nodes carry the capture's node names (torch.export).

torch.export in non-strict mode runs the model's own Python forward on fake tensors, so it
takes what torch.fx's symbolic tracer cannot (Hugging Face models, data-dependent shapes
that are only sizes, `*args` plumbing). The batch dimension of every input is exported as
a symbol, so one graph runs any share of a micro-batch. `GraphModule` parameters are the
model's own `nn.Parameter` objects, under their model names (checkpoints and sync rely on it).

Every node of the graph gets what the partitioner needs to cut it:
- `leaf_name`: the capture node it belongs to, by the capture's rule (recorder.py): the
  outermost leaf module on its module stack, '#k' for that module's k-th call (export
  writes the k-th call as '@k'); nodes outside any leaf module are *loose*;
- `data`: whether its value depends on the data of a model input. Values that do not
  (parameters, buffers, constants, and anything computed from sizes alone: position ids,
  causal masks, rotary tables, `arange(batch)`) are *replicable*: each stage that needs one
  recomputes it rather than receive it, because a size-derived value must be computed from
  the consumer's own sample count, and a batch-independent one has no samples to split;
- `layout`: where a data tensor keeps its samples (`BatchLayout`), so a value that crosses
  between stages can be turned batch-first for the transfer and back (seq-first models
  such as XLNet, or a flattened batch × sequence dimension);
- `loose_run`: for a loose node, (parent path, k): it belongs to the k-th loose run of that
  parent, which the capture names '<parent>::<first op>@k' (recorder.py). The export runs
  the model's Python forward in eager order, so runs are counted the capture's way: a run
  is a maximal stretch of ops the parent runs itself between its leaf calls (sizes and
  tuple unpacking, which the dispatcher never sees, neither start nor break one). The op
  names differ (export keeps composite ops the dispatcher decomposes), so only (parent, k)
  is matched.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, export
from torch.utils._pytree import tree_flatten

from heterog.errors import PlanError


class LayoutKind(StrEnum):
    FIRST = "first"  # samples along dim 0: crosses as it is
    MOVED = "moved"  # samples along dim `dim` > 0: moved to the front for the transfer
    FLAT = "flat"  # dim 0 is samples × `factor` (batch-major): unflattened for the transfer
    NONE = "none"  # no sample dimension (e.g. a reduction over the batch): cannot cross
    OTHER = "other"  # not a tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLayout:
    kind: LayoutKind
    dim: int = 0
    factor: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportedModel:
    """The exported graph and what each node means for a split (see the module docstring)."""

    module: fx.GraphModule
    leaf_name: dict[fx.Node, str]
    data: frozenset[fx.Node]
    layout: dict[fx.Node, BatchLayout]
    num_outputs: int
    loose_run: dict[fx.Node, tuple[str, int]]


def is_leaf_module(module: nn.Module) -> bool:
    """The capture's placement unit: a module without child modules (recorder.is_leaf_module)."""
    return next(iter(module.children()), None) is None


def export_model(model: nn.Module, example_inputs: tuple[Any, ...]) -> ExportedModel:
    """Export `model` (train mode kept: dropout stays random, batch norm updates its
    statistics) with a symbolic batch dimension on every tensor input."""
    dynamic = tuple({0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in example_inputs)
    with torch.random.fork_rng(devices=[]):
        ep = export(model, tuple(example_inputs), dynamic_shapes=dynamic, strict=False)
    gm = ep.module()
    _drop_guards(gm)
    symbols = _batch_symbols(gm)
    if not symbols:
        raise PlanError(
            "the exported model fixed its batch size (no input kept a symbolic "
            "dimension 0), so it cannot run on a replica's share of the batch. Make "
            "the model's forward independent of the batch size."
        )
    data = _data_nodes(gm)
    layout = {n: _layout(n.meta.get("val"), symbols) for n in gm.graph.nodes}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    num_outputs = len([a for a in tree_flatten(out.args[0])[0] if isinstance(a, fx.Node)])
    leaf_name = _leaf_names(gm, model)
    return ExportedModel(
        module=gm,
        leaf_name=leaf_name,
        data=frozenset(data),
        layout=layout,
        num_outputs=num_outputs,
        loose_run=_loose_runs(gm, leaf_name),
    )


def _drop_guards(gm: fx.GraphModule) -> None:
    """ep.module() checks input shapes against the export's guards in a `_guards_fn` call;
    the split stages see other batch sizes (any share, also 1), so drop it."""
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and str(n.target).startswith("_guards_fn") and not n.users:
            gm.graph.erase_node(n)
    for name in [k for k in gm._modules if k.startswith("_guards_fn")]:
        delattr(gm, name)
    gm.recompile()


def _batch_symbols(gm: fx.GraphModule) -> set[Any]:
    out: set[Any] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            size = val.shape[0]
            if isinstance(size, torch.SymInt):
                out.add(size.node.expr)
    return out


def _layout(val: Any, symbols: set[Any]) -> BatchLayout:
    if not isinstance(val, torch.Tensor):
        return BatchLayout(kind=LayoutKind.OTHER)
    exprs = [d.node.expr if isinstance(d, torch.SymInt) else None for d in val.shape]
    dims = [i for i, e in enumerate(exprs) if e is not None and e in symbols]
    if dims and dims[0] == 0:
        return BatchLayout(kind=LayoutKind.FIRST)
    if dims:
        return BatchLayout(kind=LayoutKind.MOVED, dim=dims[0])
    if exprs and exprs[0] is not None:
        for s in symbols:
            factor = exprs[0] / s
            if factor.is_Integer and int(factor) > 1:
                return BatchLayout(kind=LayoutKind.FLAT, factor=int(factor))
    return BatchLayout(kind=LayoutKind.NONE)


def _data_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on the data (not only the sizes) of a model input."""
    data: set[fx.Node] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor):
                data.add(n)
        elif n.op == "call_function":
            if n.target is operator.getitem:
                if n.args[0] in data and isinstance(val, torch.Tensor):
                    data.add(n)
            elif _is_tensor_value(val) and any(a in data for a in n.all_input_nodes):
                data.add(n)
    return data


def _is_tensor_value(val: Any) -> bool:
    leaves = tree_flatten(val)[0]
    return bool(leaves) and any(isinstance(v, torch.Tensor) for v in leaves)


def _leaf_names(gm: fx.GraphModule, model: nn.Module) -> dict[fx.Node, str]:
    leaf_of_path: dict[str, bool] = {}
    names: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for key, value in (n.meta.get("nn_module_stack") or {}).items():
            path = value[0] if isinstance(value, tuple) else ""
            if not isinstance(path, str) or not path:
                continue
            if path not in leaf_of_path:
                try:
                    leaf_of_path[path] = is_leaf_module(model.get_submodule(path))
                except AttributeError:
                    leaf_of_path[path] = False
            if leaf_of_path[path]:
                k = key.rsplit("@", 1)[1] if "@" in key else "0"
                names[n] = path if k == "0" else f"{path}#{k}"
                break
    return names


def _loose_runs(gm: fx.GraphModule, leaf_name: dict[fx.Node, str]) -> dict[fx.Node, tuple[str, int]]:
    """Loose node → (parent path or 'root', k), counted as the capture counts loose runs."""
    runs: dict[str, int] = {}
    out: dict[fx.Node, tuple[str, int]] = {}
    context: tuple[str, str] | None = None
    current: tuple[str, int] | None = None
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or not _is_tensor_value(n.meta.get("val")):
            continue
        if n in leaf_name:
            context = ("leaf", leaf_name[n])
            continue
        paths = [
            v[0]
            for v in (n.meta.get("nn_module_stack") or {}).values()
            if isinstance(v, tuple) and isinstance(v[0], str) and v[0]
        ]
        parent = paths[-1] if paths else "root"
        if context != ("loose", parent):
            context = ("loose", parent)
            current = (parent, runs.get(parent, 0))
            runs[parent] = current[1] + 1
        assert current is not None
        out[n] = current
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CutConstraints:
    """What a planner must respect so that the executor runs its grouping as planned.

    `follow_consumers`: capture nodes that depend on no input data (position embeddings,
    rotary tables, masks built from sizes): they run, and their parameters live, in the
    group(s) of their consumers, whatever group the plan gives them. `same_placement`:
    (producer, consumer) capture nodes whose value has no sample dimension yet needs a
    gradient (e.g. a statistic over the batch): a cut between groups with different
    replicas or shares there is refused (for a loose consumer: with any group it may run
    in). The search reads both (search/constraints.py); in the zoo, `same_placement` is
    empty and `follow_consumers` holds e.g. GPT-2's position embedding."""

    follow_consumers: frozenset[str]
    same_placement: frozenset[tuple[str, str]]


def cut_constraints(model: nn.Module, example_inputs: tuple[Any, ...]) -> CutConstraints:
    """The CutConstraints of `model` (exports it once; seconds for the zoo's models)."""
    exported = export_model(model, example_inputs)
    named = exported.leaf_name
    follow = {named[n] for n in named if n not in exported.data}
    follow -= {named[n] for n in named if n in exported.data}  # a leaf with data work stays put
    pairs: set[tuple[str, str]] = set()
    for p in exported.module.graph.nodes:
        val = p.meta.get("val")
        if (
            p in exported.data
            and exported.layout[p].kind is LayoutKind.NONE
            and isinstance(val, torch.Tensor)
            and val.is_floating_point()
        ):
            a = nearest_name(p, named)
            for u in p.users:
                if u in exported.data:
                    pairs.update((a, b) for b in sorted(_runs_with(u, named, exported.data)) if b != a)
    return CutConstraints(follow_consumers=frozenset(follow), same_placement=frozenset(pairs))


def _runs_with(n: fx.Node, named: dict[fx.Node, str], data: frozenset[fx.Node]) -> set[str]:
    """The capture names whose group a data node may run in: its own; for a loose node (which
    runs with its latest producer, partition.py) the nearest named producers through loose
    nodes, or when it has none its nearest named consumers."""
    if n in named:
        return {named[n]}
    for step in (lambda x: x.all_input_nodes, lambda x: list(x.users)):
        found: set[str] = set()
        seen, todo = {n}, [n]
        while todo:
            for a in step(todo.pop()):
                if a in seen or a not in data:
                    continue
                seen.add(a)
                if a in named:
                    found.add(named[a])
                else:
                    todo.append(a)
        if found:
            return found
    return {nearest_name(n, named)}


def nearest_name(n: fx.Node, named: dict[fx.Node, str]) -> str:
    """A node's capture name, or for a loose node its producer's (the loose-node rule)."""
    seen = n
    while seen not in named:
        inputs = [a for a in seen.all_input_nodes if a.op == "call_function"]
        if not inputs:
            return f"<{n.name}>"
        seen = inputs[0]
    return named[seen]


def leaf_call_names(model: nn.Module, example_inputs: tuple[Any, ...]) -> list[str]:
    """The capture node names of the model's leaf-module calls that run ops, in order."""
    exported = export_model(model, example_inputs)
    return list(dict.fromkeys(exported.leaf_name[n] for n in exported.module.graph.nodes if n in exported.leaf_name))


def copy_exported(exported: ExportedModel) -> ExportedModel:
    """A copy whose graph can be cut without touching the original (the split rewrites the
    graph in place), sharing its parameters and buffers: one export serves every plan of a
    model in a multi-plan launch (heterog.run_many). The node tables follow the copied nodes."""
    graph = copy.deepcopy(exported.module.graph)  # node by node, in order; meta shared
    module = fx.GraphModule(exported.module, graph)
    module.meta.update(exported.module.meta)
    old_nodes, new_nodes = list(exported.module.graph.nodes), list(graph.nodes)
    assert len(old_nodes) == len(new_nodes), "an fx graph copy changed the number of nodes"
    nodes = dict(zip(old_nodes, new_nodes))
    return ExportedModel(
        module=module,
        leaf_name={nodes[n]: v for n, v in exported.leaf_name.items()},
        data=frozenset(nodes[n] for n in exported.data),
        layout={nodes[n]: v for n, v in exported.layout.items()},
        num_outputs=exported.num_outputs,
        loose_run={nodes[n]: v for n, v in exported.loose_run.items()},
    )
