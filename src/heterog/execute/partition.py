"""Split a model into per-group submodules that follow a Plan's groups.

The model is traced with torch.fx, treating every module without children as a leaf, the
same leaves capture (helper A) names: a `call_module` fx node is named by its target, with
'#k' appended on its k-th repeated call (k ≥ 1), exactly like an OpGraph node, so it takes
the group the plan gives that name.

Loose fx nodes (functions, methods, attribute reads), which capture names
'<parent>::<aten op>@k' and which have no one-to-one fx counterpart, follow a fixed rule:
  1. a loose node joins the group of its first input that already has a group (producer);
  2. one with no grouped input (it reads only model inputs, attributes or constants) joins
     the group of its first consumer that has a group;
  3. one with neither (dead code) joins the first group.
So a residual add runs where its first operand was computed.

Execution cuts the graph into *stages*: maximal runs of consecutive fx nodes (in execution
order) whose groups have the same replicas and shares. A stage is therefore one or more
groups run back to back without a transfer between them (the planner often emits many
small groups with one placement), and stages follow each other in topological order, so
any grouping of the graph can be executed. torch.fx's split_module cuts one submodule per
stage. Gradients are still synchronised per group, by each group's own method.

A model fx cannot trace can still run a plan that needs no split (`whole_model`): every
group on the same replicas with the same shares, i.e. data parallelism, which is how
Hugging Face models run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from heterog.errors import PlanError
from heterog.ir.plan import Plan

INPUT = -1  # owner of model inputs: every rank has the whole global batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One call of a group's submodule in the top-level dataflow."""
    value: str                  # name of the value it produces
    group: int                  # a group of the stage (all its groups share this placement)
    module: nn.Module
    args: tuple[str, ...]       # names of the values it consumes, in call order
    groups: tuple[int, ...] = ()  # every group whose nodes it runs


@dataclass(kw_only=True)
class Dataflow:
    """The split model: stages in topological order and how values flow between them."""
    inputs: tuple[str, ...]                      # model inputs, in call order
    stages: tuple[Stage, ...]
    projections: dict[str, tuple[str, int]]      # value → (stage value, tuple index)
    owner: dict[str, int]                        # value → group index (INPUT for inputs)
    output: str                                  # the value the loss is computed on
    params_of_group: dict[int, list[tuple[str, nn.Parameter]]] = field(default_factory=dict)
    param_numels: dict[int, list[int]] = field(default_factory=dict)  # kept after detach_unheld
    warnings: list[str] = field(default_factory=list)
    split: bool = True                           # False: the whole model is one stage

    def consumers(self, value: str) -> list[Stage]:
        return [s for s in self.stages if value in s.args]


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return len(m._modules) == 0


def fx_node_names(model: nn.Module) -> list[str]:
    """The leaf-module call names the tracer sees, in execution order (for tests and checks)."""
    graph = _LeafTracer().trace(model)
    return [name for _, name in _module_call_names(graph)]


def _module_call_names(graph: fx.Graph) -> list[tuple[fx.Node, str]]:
    seen: dict[str, int] = {}
    out = []
    for n in graph.nodes:
        if n.op == "call_module":
            k = seen.get(n.target, 0)
            seen[n.target] = k + 1
            out.append((n, n.target if k == 0 else f"{n.target}#{k}"))
    return out


def _group_of_names(plan: Plan) -> dict[str, int]:
    return {name: i for i, g in enumerate(plan.groups) for name in g.nodes}


def assign_groups(graph: fx.Graph, plan: Plan) -> tuple[dict[fx.Node, int], list[str]]:
    """Every computing fx node → group index, by the rule in the module docstring."""
    by_name = _group_of_names(plan)
    assign: dict[fx.Node, int] = {}
    warnings: list[str] = []
    calls = _module_call_names(graph)
    unmatched = [name for _, name in calls if name not in by_name]
    if calls and len(unmatched) == len(calls):
        raise PlanError(f"none of the model's {len(calls)} module calls (e.g. {calls[0][1]!r}) is "
                        f"named in the plan's groups (e.g. {plan.groups[0].nodes[:2]}); the plan "
                        f"was made for a different model. Re-plan for {plan.model.name!r}.")
    if unmatched:
        warnings.append(f"{len(unmatched)} module call(s) not named in the plan follow their "
                        f"producer's group, e.g. {unmatched[:3]}")
    for node, name in calls:
        if name in by_name:
            assign[node] = by_name[name]
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    for n in compute:  # rule 1: follow the producer
        if n in assign:
            continue
        for a in n.all_input_nodes:
            if a in assign:
                assign[n] = assign[a]
                break
    for n in reversed(compute):  # rule 2: follow the consumer
        if n in assign:
            continue
        for u in n.users:
            if u in assign:
                assign[n] = assign[u]
                break
    for n in compute:  # rule 3: dead code
        assign.setdefault(n, 0)
    return assign, warnings


def segments(graph: fx.Graph, assign: dict[fx.Node, int], plan: Plan) -> dict[fx.Node, int]:
    """fx node → stage index: a new stage starts wherever the placement changes."""
    seg: dict[fx.Node, int] = {}
    current, last = -1, None
    for n in graph.nodes:
        if n not in assign:
            continue
        placement = plan.groups[assign[n]].replicas
        if placement != last:
            current += 1
            last = placement
        seg[n] = current
    return seg


def split_model(model: nn.Module, plan: Plan) -> Dataflow:
    """Trace `model` and cut it into one submodule per plan group (see the module docstring)."""
    try:
        traced = fx.GraphModule(model, _LeafTracer().trace(model))
    except Exception as e:  # fx raises many types for untraceable code
        raise PlanError(
            f"model {plan.model.name!r} cannot be traced by torch.fx ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}), so it cannot be split into groups. "
            f"Plans that need no split run it: every group on the same devices with the same "
            f"shares (data parallelism).") from None
    assign, warnings = assign_groups(traced.graph, plan)
    seg = segments(traced.graph, assign, plan)
    group_of_segment = {seg[n]: assign[n] for n in reversed(list(seg))}  # first group of each
    split = split_module(traced, model, lambda n: seg[n])
    inputs: list[str] = []
    stages: list[Stage] = []
    projections: dict[str, tuple[str, int]] = {}
    owner: dict[str, int] = {}
    output: str | None = None
    segment_of: dict[str, int] = {}
    for n in split.graph.nodes:
        if n.op == "placeholder":
            inputs.append(n.name)
            owner[n.name] = INPUT
        elif n.op == "call_module":
            segment_of[n.name] = int(str(n.target).rsplit("_", 1)[1])
            group = group_of_segment[segment_of[n.name]]
            args = []
            for a in n.args:
                if not isinstance(a, fx.Node):
                    raise PlanError(f"group {plan.groups[group].name!r} receives a constant "
                                    f"argument {a!r} across a split; merge it with its producer.")
                args.append(a.name)
            stages.append(Stage(value=n.name, group=group, module=getattr(split, str(n.target)),
                                args=tuple(args)))
            owner[n.name] = group
        elif n.op == "call_function" and n.target.__name__ == "getitem":
            src, index = n.args
            projections[n.name] = (src.name, int(index))
            owner[n.name] = owner[src.name]
        elif n.op == "output":
            out = n.args[0]
            if not isinstance(out, fx.Node):
                raise PlanError(f"model {plan.model.name!r} returns {type(out).__name__} of "
                                f"several values; a split plan needs a single output tensor. Plans "
                                f"that need no split (data parallelism) run it.")
            output = out.name
        else:
            raise AssertionError(f"unexpected top-level fx node {n.op} {n.target}")
    assert output is not None
    groups_of_segment: dict[int, set[int]] = {}
    for n, k in seg.items():
        groups_of_segment.setdefault(k, set()).add(assign[n])
    stages = [dataclasses.replace(s, groups=tuple(sorted(groups_of_segment[segment_of[s.value]])))
              for s in stages]
    stages = order_stages(stages, projections, plan, {
        s.value: groups_of_segment[segment_of[s.value]] for s in stages}, segment_of)
    flow = Dataflow(inputs=tuple(inputs), stages=tuple(stages), projections=projections,
                    owner=owner, output=output, warnings=warnings)
    _collect_params(flow, traced, assign, model, plan)
    return flow


def order_stages(stages: list[Stage], projections: dict[str, tuple[str, int]], plan: Plan,
                 groups_of: dict[str, set[int]], segment_of: dict[str, int]) -> list[Stage]:
    """A topological order of the stages that runs, among the ready ones, the stage with the
    highest plan priority first (a stage's priority: the highest of its groups' nodes'; ties
    keep the traced order). Every rank computes the same order from the plan, which keeps the
    transfers deadlock-free (p2p.py); without priorities it is the traced order."""
    prio = {s.value: max((plan.priorities.get(n, 0.0) for g in groups_of[s.value]
                          for n in plan.groups[g].nodes), default=0.0) for s in stages}
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


def _collect_params(flow: Dataflow, traced: fx.GraphModule, assign: dict[fx.Node, int],
                    model: nn.Module, plan: Plan) -> None:
    """Map each group to the parameters its fx nodes use (modules called, attributes read)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    holder: dict[int, int] = {}
    for n, g in assign.items():
        if n.op == "call_module":
            params = list(traced.get_submodule(str(n.target)).parameters())
        elif n.op == "get_attr":
            obj = traced
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            params = [obj] if isinstance(obj, nn.Parameter) else []
        else:
            continue
        for p in params:
            if holder.setdefault(id(p), g) != g:
                raise PlanError(f"parameter {name_of.get(id(p), '?')!r} is used by groups "
                                f"{plan.groups[holder[id(p)]].name!r} and {plan.groups[g].name!r}; "
                                f"tied weights must lie in one group.")
            elif id(p) not in {id(q) for _, q in flow.params_of_group.get(g, [])}:
                flow.params_of_group.setdefault(g, []).append((name_of.get(id(p), "?"), p))
    seen = set(holder)
    unused = [n for n, p in model.named_parameters() if id(p) not in seen]
    if unused:
        flow.warnings.append(f"{len(unused)} parameter(s) unused in forward, e.g. {unused[:3]}")


def needs_no_split(plan: Plan) -> bool:
    """True when every group has the same replicas and shares: plain data parallelism."""
    first = plan.groups[0].replicas
    return all(g.replicas == first for g in plan.groups)


def whole_model(model: nn.Module, plan: Plan, num_inputs: int) -> Dataflow:
    """The whole model as one stage, for data-parallel plans on models fx cannot trace.

    Each parameter is synchronised with the group of its module path (a node name is a
    module path), or with the first group when no group names its module.
    """
    if not needs_no_split(plan):
        raise PlanError("this plan places groups on different devices, which needs the model split "
                        "into groups, but the model cannot be traced by torch.fx.")
    by_name = _group_of_names(plan)
    params: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        path = name.rsplit(".", 1)[0] if "." in name else ""
        group = 0
        while True:
            if path in by_name:
                group = by_name[path]
                break
            if "." not in path:
                break
            path = path.rsplit(".", 1)[0]
        params.setdefault(group, []).append((name, p))
    inputs = tuple(f"input_{i}" for i in range(num_inputs))
    stage = Stage(value="output", group=0, module=model, args=inputs, groups=tuple(range(len(plan.groups))))
    return Dataflow(inputs=inputs, stages=(stage,), projections={},
                    owner={**{i: INPUT for i in inputs}, "output": 0}, output="output",
                    params_of_group=params, split=False)


def build_dataflow(model: nn.Module, plan: Plan, num_inputs: int) -> Dataflow:
    """Split when the plan needs it or the model allows it; otherwise run it whole."""
    try:
        return split_model(model, plan)
    except PlanError as e:
        if needs_no_split(plan) and "cannot be traced" in str(e):
            flow = whole_model(model, plan, num_inputs)
            flow.warnings.append("model not fx-traceable: ran as one stage (data parallelism)")
            return flow
        raise


def param_numel_of_group(flow: Dataflow) -> dict[int, int]:
    return {g: sum(ns) for g, ns in flow.param_numels.items()}


def detach_unheld(flow: Dataflow, held_groups: set[int]) -> None:
    """Free the parameters of groups this rank does not hold (they were built for the seed)."""
    for g, ps in flow.params_of_group.items():
        flow.param_numels.setdefault(g, [p.numel() for _, p in ps])
        if g not in held_groups:
            for _, p in ps:
                p.data = torch.empty(0, dtype=p.dtype)
