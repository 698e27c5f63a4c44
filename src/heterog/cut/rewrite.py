"""Graph rewrites that make every cut of an exported model runnable (partition.py's rules).

- `replicate_per_stage`: a node that depends on no input data (a batch-independent module,
  position ids, masks and `arange(batch)` built from sizes, SymInt sizes) gets a copy in every
  stage that uses it, so such a value never crosses a cut and a size is always the
  consumer's own;
- `batch_first_across_cuts`: a data tensor whose samples are not along dim 0 is made
  batch-first before it crosses a cut and restored after it; one without a sample dimension
  that needs a gradient cannot cross between placements (a PlanError names the two nodes);
- `single_output`, `attributes_inside`: the split's plumbing (one output tensor; parameters
  and buffers held by the stage modules, as the model's own objects).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from heterog.cut.split_export import ExportedModel, LayoutKind, nearest_name
from heterog.errors import PlanError
from heterog.ir.plan import Plan


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _in_stage(copies: dict[tuple[fx.Node, int], fx.Node], stage: int) -> Callable[[fx.Node], fx.Node]:
    """Maps an argument node to its copy in `stage` (itself where it has none)."""
    return lambda a: copies.get((a, stage), a)


def replicate_per_stage(
    gm: fx.GraphModule, seg: dict[fx.Node, int], assign: dict[fx.Node, int], data: frozenset[fx.Node]
) -> None:
    """Give every replicable (non-data) node a copy in each stage that uses it; `seg` and
    `assign` are extended in place (a copy takes its first consumer's group)."""
    compute = _compute_nodes(gm)
    replicable = [n for n in compute if n not in data]
    need: dict[fx.Node, dict[int, int]] = {}  # node → stage → group of a consumer there
    for n in reversed(replicable):
        stages: dict[int, int] = {}
        for u in n.users:
            if u in seg:
                stages.setdefault(seg[u], assign[u])
            elif u in need:
                for s, g in need[u].items():
                    stages.setdefault(s, g)
        if not stages:  # no consumer (an assert, a dead value): run it beside its first input
            src = next((a for a in n.all_input_nodes if a in seg), None)
            stages = {seg[src]: assign[src]} if src is not None else {0: 0}
        need[n] = stages
    copies: dict[tuple[fx.Node, int], fx.Node] = {}
    for n in replicable:
        first = min(need[n])
        # the copies first, from the original's own inputs: once the original is rewired to
        # its stage's copies, a copy made from it would read the first stage's values
        for s, g in sorted(need[n].items(), reverse=True):
            if s == first:  # the original stays, reading the replicable inputs of its stage
                copy = n
                n.args = fx.node.map_arg(n.args, _in_stage(copies, s))
                n.kwargs = fx.node.map_arg(n.kwargs, _in_stage(copies, s))
            else:
                with gm.graph.inserting_after(n):
                    copy = gm.graph.node_copy(n, _in_stage(copies, s))
                copy.meta = n.meta
            copies[(n, s)] = copy
            seg[copy], assign[copy] = s, g
    for u in list(gm.graph.nodes):
        if u in seg and u not in need:
            s = seg[u]
            u.args = fx.node.map_arg(u.args, _in_stage(copies, s))
            u.kwargs = fx.node.map_arg(u.kwargs, _in_stage(copies, s))
    crossing = [
        (a.name, u.name)
        for u in gm.graph.nodes
        if u in seg
        for a in u.all_input_nodes
        if a in seg and a not in data and seg[a] != seg[u]
    ]
    assert not crossing, f"replicable values still cross a cut after replication: {crossing[:3]}"


def batch_first_across_cuts(
    exported: ExportedModel, seg: dict[fx.Node, int], assign: dict[fx.Node, int], plan: Plan
) -> None:
    """Make every data tensor that crosses a cut batch-first for the transfer."""
    gm = exported.module
    for p in [n for n in _compute_nodes(gm) if n in exported.data]:
        outside = [u for u in p.users if u in seg and seg[u] != seg[p]]
        if not outside:
            continue
        lay = exported.layout[p]
        if lay.kind is LayoutKind.FIRST:
            continue
        if lay.kind in (LayoutKind.NONE, LayoutKind.OTHER):
            val = p.meta.get("val")
            same = all(plan.groups[assign[u]].replicas == plan.groups[assign[p]].replicas for u in outside)
            if same and not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                continue  # the consumer's copy is the producer's own: passed whole
            raise PlanError(_cut_error(exported, p, outside[0]))
        with gm.graph.inserting_after(p):
            if lay.kind is LayoutKind.MOVED:
                front = gm.graph.call_function(torch.movedim, (p, lay.dim, 0))
            else:
                front = gm.graph.call_function(torch.unflatten, (p, 0, (-1, lay.factor)))
        seg[front], assign[front] = seg[p], assign[p]
        back_of: dict[int, fx.Node] = {}
        for u in outside:
            s = seg[u]
            if s not in back_of:
                with gm.graph.inserting_after(front):
                    if lay.kind is LayoutKind.MOVED:
                        back_of[s] = gm.graph.call_function(torch.movedim, (front, 0, lay.dim))
                    else:
                        back_of[s] = gm.graph.call_function(torch.flatten, (front, 0, 1))
                seg[back_of[s]], assign[back_of[s]] = s, assign[u]
            u.replace_input_with(p, back_of[s])


def _cut_error(exported: ExportedModel, p: fx.Node, u: fx.Node) -> str:
    src, dst = nearest_name(p, exported.leaf_name), nearest_name(u, exported.leaf_name)
    return (
        f"the value {p.name!r} computed in {src!r} and used in {dst!r} has no sample "
        f"dimension (it mixes samples, e.g. a batch statistic), so it cannot cross between "
        f"groups with different placements. Put {src!r} and {dst!r} in groups with the same "
        f"replicas and shares."
    )


def single_output(gm: fx.GraphModule) -> None:
    """Return the one output tensor itself (not the pytree the export rebuilds)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaf = [a for a in torch.utils._pytree.tree_flatten(out.args[0])[0] if isinstance(a, fx.Node)][0]
    out.args = (leaf,)
    gm.graph._codegen = fx.graph.CodeGen()


def attributes_inside(module: fx.GraphModule, split: fx.GraphModule, args: tuple) -> list[fx.Node]:
    """split_module passes tensor attributes (parameters, buffers) as arguments; make each a
    get_attr of the stage's own module instead, registered under its model name (the same
    object), so a stage holds its parameters and its callers pass only values."""
    placeholders = [p for p in module.graph.nodes if p.op == "placeholder"]
    kept = []
    for a, ph in zip(args, placeholders):
        if a.op != "get_attr":
            kept.append(a)
            continue
        value = _attr(split, str(a.target))
        *path, leaf = str(a.target).split(".")
        owner: nn.Module = module
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)
        with module.graph.inserting_after(ph):
            node = module.graph.get_attr(str(a.target))
        ph.replace_all_uses_with(node)
        module.graph.erase_node(ph)
    module.recompile()
    return kept


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
