"""Stages built for the rank's device, and the check that they are.

The split (partition.py) cuts a model exported on the CPU, so its graphs record the CPU
wherever the model's Python code made a tensor: `aten.arange(device=cpu)` for position ids,
`aten.to(device=cpu)` and `aten._assert_tensor_metadata(device=cpu)` for casts (GPT-2, BERT,
Llama and XLNet all have some); and each stage module holds the model's parameters and
buffers as they were at export. `Module.to` keeps a parameter object when it can move its
data in place (CPU → CUDA), but gives every *buffer* a new object, so moving the model
would leave the stages computing with the old CPU buffers (Llama's `inv_freq`, BERT's
`position_ids`, BatchNorm's running statistics).

So a rank places exactly the stages it runs (`place_stages`):
- every device-valued argument of every graph node becomes the rank's device — the rewrite
  `torch.export.passes.move_to_device_pass` makes, applied to the split's unlifted graphs
  (that pass works on an ExportedProgram and replaces its parameters by new objects, while
  the executor's optimizer, sync and checkpoints hold the model's own);
- parameters move with their objects kept (`torch.utils.swap_tensors` where `.data` cannot
  change device type, e.g. CPU → meta); buffers and tensor constants move once each and are
  registered anew in every stage that holds them, so a stage computes with, and updates,
  its device copy.

`misplaced` then lists what is not on the device — a node with a device argument, a
parameter, buffer or constant elsewhere — and `require_placed` refuses with the node's name
and the model module it came from, before step 1 (worker.py) and in `heterog check`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from heterog.errors import PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Misplaced:
    """One thing of a stage that is not on the rank's device."""

    stage: str  # the stage's value name
    what: str  # 'node' | 'parameter' | 'buffer' | 'constant'
    name: str  # the fx node or attribute
    module: str  # the model module it belongs to ('' when unknown)
    device: str  # where it is

    def describe(self) -> str:
        where = f" (model module {self.module!r})" if self.module else ""
        return f"{self.what} {self.name!r} of stage {self.stage!r}{where} is on {self.device}"


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:<current> are the same place for a rank; otherwise type and index."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _as_device(x: Any) -> torch.device | None:
    if isinstance(x, torch.device):
        return x
    return None


def _graph_modules(module: nn.Module) -> Iterable[fx.GraphModule]:
    return (m for m in module.modules() if isinstance(m, fx.GraphModule))


def rewrite_node_devices(module: nn.Module, device: torch.device) -> int:
    """Every device-valued argument of every node (nested graphs included) set to `device`;
    returns how many nodes changed."""
    changed = 0
    for gm in _graph_modules(module):
        for node in gm.graph.nodes:
            hit = False

            def swap(a: Any) -> Any:
                nonlocal hit
                d = _as_device(a)
                if d is not None and not _same_device(d, device):
                    hit = True
                    return device
                return a

            args = fx.node.map_aggregate(node.args, swap)
            kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if isinstance(kwargs.get("device"), str) and not _same_device(torch.device(kwargs["device"]), device):
                kwargs = {**kwargs, "device": device}
                hit = True
            if hit:
                node.args, node.kwargs = args, kwargs
                changed += 1
        gm.recompile()
    return changed


def rewrite_stage_devices(stages: Iterable[Any], device: torch.device) -> None:
    """rewrite_node_devices for every stage of a split (`Stage` objects), also those this rank
    does not run: the wire table runs them all on fake tensors of the rank's device."""
    for stage in stages:
        rewrite_node_devices(stage.module, device)


def _moved_parameter(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """`p` on `device`: the same object when its data can change device in place (CPU →
    CUDA, as Module.to does), else a new Parameter (CPU → meta) that the caller puts in its
    place everywhere (`place_stages` returns them)."""
    moved = p.detach().to(device)
    if torch._has_compatible_shallow_copy_type(p.data, moved):
        p.data = moved
        return p
    return nn.Parameter(moved, requires_grad=p.requires_grad)


def _tensor_attributes(module: nn.Module) -> Iterable[tuple[nn.Module, str, torch.Tensor, str]]:
    """(owner, attribute, tensor, kind) for every buffer and plain tensor attribute (an
    export's lifted constants) of `module` and its children."""
    for owner in module.modules():
        for name, buf in list(owner._buffers.items()):
            if buf is not None:
                yield owner, name, buf, "buffer"
        for name, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and name not in owner._buffers:
                yield owner, name, value, "constant"


def place_stages(modules: Iterable[nn.Module], device: torch.device) -> dict[int, nn.Parameter]:
    """Put the given stage modules on `device` (module docstring): node arguments,
    parameters, buffers and constants, each tensor moved once and shared by every stage that
    holds it. Returns {id(old parameter): its replacement} for parameters that could not keep
    their object (see `_moved_parameter`; empty for CPU → CUDA), so the caller can update
    what else refers to them."""
    moved: dict[int, torch.Tensor] = {}
    replaced: dict[int, nn.Parameter] = {}
    for module in modules:
        rewrite_node_devices(module, device)
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is None or _same_device(p.device, device):
                    continue
                if id(p) not in moved:
                    moved[id(p)] = new = _moved_parameter(p, device)
                    if new is not p:
                        replaced[id(p)] = new
                owner._parameters[name] = moved[id(p)]  # type: ignore[assignment]
        for owner, name, t, kind in list(_tensor_attributes(module)):
            if _same_device(t.device, device):
                continue
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            if kind == "buffer":
                owner._buffers[name] = moved[id(t)]
            else:
                setattr(owner, name, moved[id(t)])
    return replaced


def _module_path(node: fx.Node) -> str:
    """The model module a node was traced in (the innermost on its export module stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str) and v[0]]
    return paths[-1] if paths else ""


def _attribute_users(module: nn.Module) -> dict[str, str]:
    """Attribute target → the model module of its first user node."""
    out: dict[str, str] = {}
    for gm in _graph_modules(module):
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                user = next(iter(node.users), None)
                out.setdefault(str(node.target), _module_path(user) if user is not None else "")
    return out


def _devices_in(args: Any) -> list[torch.device]:
    """The torch.device values anywhere in a node's (nested) arguments."""
    found: list[torch.device] = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return found


def misplaced(stages: Iterable[tuple[str, nn.Module]], device: torch.device) -> list[Misplaced]:
    """What of the given (name, stage module) pairs is not on `device`, nodes first."""
    found: list[Misplaced] = []
    for stage, module in stages:
        for gm in _graph_modules(module):
            for node in gm.graph.nodes:
                devices = _devices_in((node.args, node.kwargs))
                if isinstance(node.kwargs.get("device"), str):
                    devices.append(torch.device(node.kwargs["device"]))
                bad = next((d for d in devices if not _same_device(d, device)), None)
                if bad is not None:
                    found.append(
                        Misplaced(
                            stage=stage,
                            what="node",
                            name=f"{node.name} ({node.target})",
                            module=_module_path(node),
                            device=str(bad),
                        )
                    )
        users = _attribute_users(module)
        for name, p in module.named_parameters():
            if not _same_device(p.device, device) and p.numel():
                found.append(
                    Misplaced(
                        stage=stage, what="parameter", name=name, module=users.get(name, ""), device=str(p.device)
                    )
                )
        for owner, attr, t, kind in _tensor_attributes(module):
            if not _same_device(t.device, device):
                path = next((n for n, m in module.named_modules() if m is owner), "")
                full = f"{path}.{attr}" if path else attr
                found.append(
                    Misplaced(stage=stage, what=kind, name=full, module=users.get(full, ""), device=str(t.device))
                )
    return found


def require_placed(stages: Iterable[tuple[str, nn.Module]], device: torch.device, *, rank: int | None = None) -> None:
    """Raise PlanError naming the first things not on `device` (up to three)."""
    bad = misplaced(stages, device)
    if not bad:
        return
    who = f"rank {rank}: " if rank is not None else ""
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    raise PlanError(
        f"{who}the model's stages are not all on {device}: "
        + "; ".join(m.describe() for m in bad[:3])
        + more
        + ". A tensor the model makes on a fixed device cannot run on this rank's device: "
        "create it on the device of the module's inputs (e.g. device=x.device)."
    )


def place_rank(
    flow: Any, held: set[int], device: torch.device, *, rank: int | None = None
) -> list[tuple[str, nn.Module]]:
    """Place the stages a rank runs (those of its held groups) and its held parameters on
    `device`, point the split's tables at any parameter that had to be replaced, and check
    the result (require_placed); returns the (name, module) of the placed stages."""
    stages = [(s.value, s.module) for s in flow.stages if set(s.groups or (s.group,)) & held]
    if device.type == "cpu" and not misplaced(stages, device):
        return stages
    replaced = place_stages([m for _, m in stages], device)
    for g in held:
        for i, (name, p) in enumerate(flow.params_of_group.get(g, [])):
            new = replaced.get(id(p))
            if new is None and _same_device(p.device, device):
                new = p
            if new is None:
                new = replaced[id(p)] = _moved_parameter(p, device)
            flow.params_of_group[g][i] = (name, new)
    if replaced:
        by_id = {id(p): n for n, p in flow.param_by_name.items()}
        for old_id, new in replaced.items():
            if old_id in by_id:
                flow.param_by_name[by_id[old_id]] = new
    require_placed(stages, device, rank=rank)
    return stages
