"""Split a model into per-stage submodules that follow a Plan's groups.

The model is exported to one aten graph (split_export.py: torch.export, non-strict, with a
symbolic batch), so every model the capture accepts can be cut, Hugging Face models
included. Each aten node inside a leaf-module call carries that call's capture node name
('#k' on the k-th repeated call) and takes the group the plan gives that name.

Loose nodes (ops a container module runs itself: residual adds, attention reshapes), which
capture names '<parent>::<aten op>@k' (the k-th run of such ops in that parent), follow the
plan where it names their run, so that values cross between the groups the Program moves
them between (split_export.py matches runs by parent and k). Otherwise they follow a fixed
rule, in the *group order* (the order the Program runs the groups in; the plan's group
order when no Program is given):
  1. a loose node joins the latest group, in group order, among its inputs' groups: it runs
     as soon as all its operands exist (a residual add runs with its later operand);
  2. one with no grouped input (it reads only model inputs, attributes or constants) joins
     the earliest group among its consumers';
  3. one with neither (dead code) joins the first group.
A Program computes each group once per micro-batch, so no group may need a value of a group
that runs after it: a loose node whose operands come later than its group (the export may
trace ops out of the capture's order) is moved to the later group, and a named node only
keeps a group before its inputs' if the plan itself puts it there (a cycle among groups,
which the Program refuses; the split alone still runs it, as interleaved stages).

Execution cuts the graph into *stages*: the data nodes are ordered by group (a topological
order that runs every node of an earlier group first, where dependencies allow), and a stage
is a maximal run of that order whose groups have the same replicas and shares and are
consecutive in group order. A stage is one or more groups run back to back without a
transfer between them, so any grouping of the graph can be executed. Three rules keep
every cut runnable:
- values that do not depend on input data (parameters read through a batch-independent
  module, position ids, masks and `arange(batch)` built from sizes, SymInt sizes) never
  cross a cut: each stage that uses one recomputes it from its own inputs (cut_rewrite.py);
- a tensor whose samples are not along dim 0 is made batch-first for the transfer and
  restored on the other side (seq-first XLNet, flattened batch × seq);
- a tensor without a sample dimension that needs gradients (a reduction over the batch)
  cannot cross: the split names the two nodes that must share a placement.
`split_export.cut_constraints(model, example_inputs)` lists, for a planner, the nodes that
follow their consumers (the first rule) and the pairs the last rule keeps together.

The export holds the model, not its loss: when the plan puts the capture's loss node in
another run of blocks than the model's output, a loss stage there receives the output (the
Program sends it, e.g. a language model's logits) and the loss is computed in it.

A parameter used by nodes of several groups (a tied embedding and output projection, or a
batch-independent module recomputed in several stages) is *tied*: every group using it holds
a copy, listed in `Dataflow.tied`, whose gradients sync.py sums across all holders every step.

A model torch.export cannot take (Python control flow on tensor values) still runs a plan
that needs no split (`whole_model`): every group on the same replicas with the same shares.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from heterog.cut.assign import (
    GroupOrder,
    assign_groups,
    group_major_order,
    group_of_names,
    group_order_of,
    segments,
)
from heterog.cut.dataflow import GROUP_META, INPUT, Dataflow, Stage
from heterog.cut.loss_stage import LOSS_VALUE, LossInput, loss_group_apart
from heterog.cut.rewrite import attributes_inside, batch_first_across_cuts, replicate_per_stage, single_output
from heterog.cut.split_export import ExportedModel, export_model
from heterog.errors import PlanError
from heterog.ir.plan import Plan
from heterog.workload import resolve_workload


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return len(m._modules) == 0


def fx_node_names(model: nn.Module) -> list[str]:
    """The leaf-module call names torch.fx's tracer sees, in execution order, for models it
    can trace (tests compare them with the capture's names; the split itself uses export)."""
    graph = _LeafTracer().trace(model)
    seen: dict[str, int] = {}
    out = []
    for n in graph.nodes:
        if n.op == "call_module":
            k = seen.get(n.target, 0)
            seen[n.target] = k + 1
            out.append(n.target if k == 0 else f"{n.target}#{k}")
    return out


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def split_model(
    model: nn.Module,
    plan: Plan,
    example_inputs: tuple[Any, ...] | None = None,
    group_order: Sequence[int] | Sequence[Sequence[int]] | None = None,
    exported: ExportedModel | None = None,
) -> Dataflow:
    """Export `model` and cut it into one submodule per stage (see the module docstring).
    Without `example_inputs`, a small batch of the plan's model is made to export with.
    `group_order`: the Program's blocks, each its groups, in the order it runs them
    (`program_group_order`: one stage per block), or a flat order of the groups; the plan's
    order when None. `exported`: the model's export to cut instead of exporting it again
    (it is rewritten in place: pass a `copy_exported` copy to keep the original)."""
    if exported is None:
        exported = export_plan_model(model, plan, example_inputs)
    if exported.num_outputs != 1:
        raise PlanError(
            f"model {plan.model.name!r} returns {exported.num_outputs} tensors; a split "
            f"plan needs a single output tensor (the loss input). Plans that need no split "
            f"(data parallelism) run it."
        )
    go = group_order_of(plan, group_order)
    assign, warnings = assign_groups(exported, plan, go.pos)
    gm = exported.module
    order = group_major_order(_compute_nodes(gm), assign, go.pos)
    seg = segments(order, assign, plan, go)
    replicate_per_stage(gm, seg, assign, exported.data)
    batch_first_across_cuts(exported, seg, assign, plan)
    single_output(gm)
    gm.graph.lint()
    gm.recompile()
    for n, g in assign.items():  # split_module copies meta: each stage output's group
        n.meta[GROUP_META] = g  # (per-stage copies of a replicable node share one meta;
        # such values never leave their stage)
    split = split_module(gm, model, lambda n: seg[n])
    flow = _dataflow(split, seg, assign, plan, warnings, go)
    _collect_params(flow, gm, seg, assign, model, plan)
    _loss_stage(flow, plan, go)
    return flow


def export_plan_model(model: nn.Module, plan: Plan, example_inputs: tuple[Any, ...] | None = None) -> ExportedModel:
    """`model` exported for splitting (split_export.export_model), or a PlanError saying that
    torch.export cannot take it. Without `example_inputs`, a small batch of the plan's model."""
    if example_inputs is None:
        example_inputs = example_batch_for(plan)
    try:
        return export_model(model, tuple(example_inputs))
    except PlanError:
        raise
    except Exception as e:  # export raises many types for code it cannot take
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PlanError(
            f"model {plan.model.name!r} cannot be exported by torch.export ({type(e).__name__}: "
            f"{first[:300]}), so it cannot be split into groups. Plans that need no split run it: "
            f"every group on the same devices with the same shares (data parallelism)."
        ) from None


def _dataflow(
    split: fx.GraphModule,
    seg: dict[fx.Node, int],
    assign: dict[fx.Node, int],
    plan: Plan,
    warnings: list[str],
    go: GroupOrder,
) -> Dataflow:
    """The top-level graph of split_module as stages, projections and owners. A stage runs
    every group from its first to its last in group order (a group with no node of its own
    in between, of the same placement, is part of it: the Program runs it there); a value's
    owner is the group that computes it."""
    groups_of_segment, first_group = _segment_groups(seg, assign, plan, go)
    inputs: list[str] = []
    stages: list[Stage] = []
    projections: dict[str, tuple[str, int]] = {}
    owner: dict[str, int] = {}
    output: str | None = None
    segment_of: dict[str, int] = {}
    made_by: dict[str, int | tuple[int, ...]] = {}  # stage → group producing its output(s)
    no_grad: set[str] = set()
    for n in split.graph.nodes:
        if n.op == "placeholder":
            inputs.append(n.name)
            owner[n.name] = INPUT
        elif n.op == "call_module":
            k = int(str(n.target).rsplit("_", 1)[1])
            segment_of[n.name] = k
            for a in n.args:
                if not isinstance(a, fx.Node):
                    raise PlanError(
                        f"group {plan.groups[first_group[k]].name!r} receives a constant "
                        f"argument {a!r} across a split; merge it with its producer."
                    )
            module = getattr(split, str(n.target))
            args = attributes_inside(module, split, n.args)
            stages.append(
                Stage(
                    value=n.name,
                    group=first_group[k],
                    module=module,
                    args=tuple(a.name for a in args),
                    groups=tuple(sorted(groups_of_segment[k])),
                )
            )
            made_by[n.name] = _producer_groups(module, first_group[k])
            integer = _integer_outputs(module)
            if integer is True:
                no_grad.add(n.name)
            elif isinstance(integer, tuple):
                no_grad.update(f"{n.name}[{i}]" for i, flag in enumerate(integer) if flag)
            made_here = made_by[n.name]
            owner[n.name] = made_here if isinstance(made_here, int) else first_group[k]
        elif n.op == "call_function" and n.target is operator.getitem:
            src, index = n.args
            projections[n.name] = (src.name, int(index))
            made = made_by.get(src.name)
            owner[n.name] = made[int(index)] if isinstance(made, tuple) else owner[src.name]
            if f"{src.name}[{int(index)}]" in no_grad:
                no_grad.add(n.name)
        elif n.op == "output":
            out = n.args[0]
            assert isinstance(out, fx.Node), out
            output = out.name
        elif n.op != "get_attr":
            raise AssertionError(f"unexpected top-level fx node {n.op} {n.target}")
    assert output is not None
    ordered = order_stages(stages, projections, plan, {s.value: set(s.groups) for s in stages}, segment_of)
    return Dataflow(
        inputs=tuple(inputs),
        stages=tuple(ordered),
        projections=projections,
        owner=owner,
        output=output,
        warnings=warnings,
        no_grad=frozenset(no_grad),
    )


def _segment_groups(
    seg: dict[fx.Node, int], assign: dict[fx.Node, int], plan: Plan, go: GroupOrder
) -> tuple[dict[int, set[int]], dict[int, int]]:
    """Per segment (stage): the groups it runs — its nodes' groups and, where they share its
    placement, the groups between them in group order (or the rest of their Program block) —
    and the first of them in group order."""
    pos = go.pos
    by_pos = sorted(range(len(plan.groups)), key=lambda g: pos[g])
    groups_of_segment: dict[int, set[int]] = {}
    first_group: dict[int, int] = {}
    for n, k in seg.items():
        groups_of_segment.setdefault(k, set()).add(assign[n])
    for k, gs in groups_of_segment.items():
        lo, hi = min(pos[g] for g in gs), max(pos[g] for g in gs)
        span = by_pos[lo : hi + 1]
        if go.block is not None:  # the whole block, its groups without nodes here included
            span = [g for g in range(len(plan.groups)) if go.block[g] in {go.block[x] for x in gs}]
        if all(plan.groups[g].replicas == plan.groups[span[0]].replicas for g in span):
            gs.update(span)
        first_group[k] = min(gs, key=lambda g: pos[g])
    return groups_of_segment, first_group


def _loss_stage(flow: Dataflow, plan: Plan, go: GroupOrder) -> None:
    """A stage that computes the loss where the plan places it (loss_stage.py), fed the
    model's output, when that is another run of blocks than the output's."""
    out = flow.projections.get(flow.output, (flow.output, 0))[0]
    producer = next(s for s in flow.stages if s.value == out)
    g = loss_group_apart(plan, go, producer.groups, flow.owner[flow.output])
    if g is None:
        return
    assert LOSS_VALUE not in flow.owner, f"the split already names a value {LOSS_VALUE!r}"
    flow.stages = (*flow.stages, Stage(value=LOSS_VALUE, group=g, module=LossInput(), args=(flow.output,), groups=(g,)))
    flow.owner[LOSS_VALUE] = g
    flow.output = LOSS_VALUE


def _producer_groups(module: fx.GraphModule, default: int) -> int | tuple[int, ...]:
    """The group that computes each output of a stage: a stage spanning several groups sends
    each value from its producer's group, where the Program sends it from."""

    def group(a: Any) -> int:
        return a.meta.get(GROUP_META, default) if isinstance(a, fx.Node) else default

    out = next(n for n in module.graph.nodes if n.op == "output").args[0]
    return tuple(group(a) for a in out) if isinstance(out, (tuple, list)) else group(out)


def _integer_outputs(module: fx.GraphModule) -> bool | tuple[bool, ...]:
    """Whether each output of a stage is known to be a tensor that cannot carry a gradient
    (integer or bool: token ids after a view); a node without a recorded value (one a cut
    rewrite inserted) counts as differentiable."""

    def integer(a: Any) -> bool:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        return isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())

    out = next(n for n in module.graph.nodes if n.op == "output").args[0]
    return tuple(integer(a) for a in out) if isinstance(out, (tuple, list)) else integer(out)


def order_stages(
    stages: list[Stage],
    projections: dict[str, tuple[str, int]],
    plan: Plan,
    groups_of: dict[str, set[int]],
    segment_of: dict[str, int],
) -> list[Stage]:
    """A topological order of the stages that runs, among the ready ones, the stage with the
    highest plan priority first (a stage's priority: the highest of its groups' nodes'; ties
    keep the traced order). Every rank computes the same order from the plan, which keeps the
    transfers deadlock-free (transport.py); without priorities it is the traced order."""
    prio = {
        s.value: max(
            (plan.priorities.get(n, 0.0) for g in groups_of[s.value] for n in plan.groups[g].nodes), default=0.0
        )
        for s in stages
    }
    index = {s.value: segment_of[s.value] for s in stages}
    deps = {s.value: {projections.get(a, (a, 0))[0] for a in s.args} & set(index) for s in stages}
    done: set[str] = set()
    out: list[Stage] = []
    while len(out) < len(stages):
        ready = [s for s in stages if s.value not in done and deps[s.value] <= done]
        nxt = max(ready, key=lambda s: (prio[s.value], -index[s.value]))
        out.append(nxt)
        done.add(nxt.value)
    return out


def _collect_params(
    flow: Dataflow,
    gm: fx.GraphModule,
    seg: dict[fx.Node, int],
    assign: dict[fx.Node, int],
    model: nn.Module,
    plan: Plan,
) -> None:
    """Map each group to the parameters its nodes read; a parameter read by several groups
    is tied (every one of them holds a copy)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    users: dict[str, list[int]] = {}
    by_name: dict[str, nn.Parameter] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        obj = gm.get_parameter(str(n.target)) if _is_param(gm, str(n.target)) else None
        if obj is None:
            continue
        name = name_of.get(id(obj), str(n.target))
        by_name[name] = obj
        for u in n.users:
            if u in assign and assign[u] not in users.setdefault(name, []):
                users[name].append(assign[u])
    for name, groups in users.items():
        for g in groups:
            flow.params_of_group.setdefault(g, []).append((name, by_name[name]))
        if len(groups) > 1:
            flow.tied[name] = tuple(sorted(groups))
    flow.param_names = {g: tuple(n for n, _ in ps) for g, ps in flow.params_of_group.items()}
    flow.param_numel = {n: p.numel() for n, p in by_name.items()}
    flow.param_shape = {n: p.shape for n, p in by_name.items()}
    flow.param_by_name = dict(by_name)
    unused = [(n, p) for n, p in model.named_parameters() if n not in users]
    by_node = {name: g for g, grp in enumerate(plan.groups) for name in grp.nodes}
    for name, p in unused:  # no gradient, but a holder keeps it (checkpoints, equal dumps)
        g = _group_of_module(name, by_node)
        flow.params_of_group.setdefault(g, []).append((name, p))
        flow.param_names[g] = flow.param_names.get(g, ()) + (name,)
        flow.param_numel[name] = p.numel()
        flow.param_shape[name] = p.shape
        flow.param_by_name[name] = p
    flow.unused = frozenset(n for n, _ in unused)
    if unused:
        flow.warnings.append(
            f"{len(unused)} parameter(s) unused in forward, held by the group of "
            f"their module, e.g. {[n for n, _ in unused[:3]]}"
        )


def _group_of_module(param: str, group_of_node: dict[str, int]) -> int:
    """The group of the closest enclosing module named in the plan (a node name is a module
    path), else the first group."""
    path = param.rsplit(".", 1)[0] if "." in param else ""
    while path:
        if path in group_of_node:
            return group_of_node[path]
        path = path.rsplit(".", 1)[0] if "." in path else ""
    return 0


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def example_batch_for(plan: Plan) -> tuple[Any, ...]:
    """A small synthetic batch of the plan's model (2–4 samples) to export it with; the RNG
    state is left untouched, so the run's seeded batches and parameters do not move."""
    work = resolve_workload(plan.model)
    with torch.random.fork_rng(devices=[]):
        inputs, _ = work.example_batch(max(2, min(plan.batch_size, 4)), work.seq_len)
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def needs_no_split(plan: Plan) -> bool:
    """True when every group has the same replicas and shares: plain data parallelism."""
    first = plan.groups[0].replicas
    return all(g.replicas == first for g in plan.groups)


def whole_model(model: nn.Module, plan: Plan, num_inputs: int) -> Dataflow:
    """The whole model as one stage, for data-parallel plans on models export cannot take.

    Each parameter is synchronised with the group of its module path (a node name is a
    module path), or with the first group when no group names its module.
    """
    if not needs_no_split(plan):
        raise PlanError(
            "this plan places groups on different devices, which needs the model split "
            "into groups, but the model cannot be exported by torch.export."
        )
    by_name = group_of_names(plan)
    params: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        params.setdefault(_group_of_module(name, by_name), []).append((name, p))
    inputs = tuple(f"input_{i}" for i in range(num_inputs))
    stage = Stage(value="output", group=0, module=model, args=inputs, groups=tuple(range(len(plan.groups))))
    return Dataflow(
        inputs=inputs,
        stages=(stage,),
        projections={},
        owner={**{i: INPUT for i in inputs}, "output": 0},
        output="output",
        params_of_group=params,
        split=False,
        param_names={g: tuple(n for n, _ in ps) for g, ps in params.items()},
        param_numel={n: p.numel() for n, p in model.named_parameters()},
        param_shape={n: p.shape for n, p in model.named_parameters()},
        param_by_name=dict(model.named_parameters()),
    )


def build_dataflow(
    model: nn.Module,
    plan: Plan,
    num_inputs: int,
    example_inputs: tuple[Any, ...] | None = None,
    group_order: Sequence[int] | Sequence[Sequence[int]] | None = None,
    exported: ExportedModel | None = None,
) -> Dataflow:
    """Split when the model exports; otherwise run it whole when the plan allows.
    `exported`: as in split_model."""
    try:
        return split_model(model, plan, example_inputs, group_order, exported)
    except PlanError as e:
        if needs_no_split(plan) and "cannot be exported" in str(e):
            flow = whole_model(model, plan, num_inputs)
            flow.warnings.append(
                "model not exportable (torch.export; not fx-traceable either): ran as one stage (data parallelism)"
            )
            return flow
        raise


def program_group_order(program: Any) -> list[tuple[int, ...]]:
    """The groups of each *run* of a lowered Program, in the order it runs them: a run is
    a stretch of consecutive blocks of one placement of which no block reads another's
    output through an input piece (a fused run cut into gradient buckets: it receives only
    at its start, so it must be one stage). One stage per run: a stage over several runs
    would receive a value once per run."""
    sources: dict[int, set[int]] = {}
    for instructions in program.instructions.values():
        for ins in instructions:
            for piece in getattr(ins, "inputs", ()):
                sources.setdefault(ins.block, set()).add(piece.block)
    runs: list[list[int]] = []
    for b, block in enumerate(program.blocks):
        prev = runs[-1] if runs else None
        if (
            prev is not None
            and (block.devices, block.shares) == (program.blocks[prev[0]].devices, program.blocks[prev[0]].shares)
            and not sources.get(b, set()) & set(prev)
        ):
            prev.append(b)
        else:
            runs.append([b])
    return [tuple(g for b in run for g in program.blocks[b].groups) for run in runs]
