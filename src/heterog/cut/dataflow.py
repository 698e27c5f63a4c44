"""The split model as the executor runs it: stages in topological order, the values that
flow between them, which group owns each value and which parameters each group holds
(partition.py builds it; the executor's runtime, transport, sync and placement read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

INPUT = -1  # owner of model inputs: every rank has the whole global batch
GROUP_META = "heterog_group"  # fx node meta key: the group a data node runs in


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One call of a stage's submodule in the top-level dataflow."""

    value: str  # name of the value it produces
    group: int  # a group of the stage (all its groups share this placement)
    module: nn.Module
    args: tuple[str, ...]  # names of the values it consumes, in call order
    groups: tuple[int, ...] = ()  # every group whose nodes it runs


@dataclass(kw_only=True)
class Dataflow:
    """The split model: stages in topological order and how values flow between them.

    `params_of_group` is this rank's view (detach_unheld lists a tied parameter under one
    held group only, so an optimizer never sees it twice); `param_names` keeps every group's
    full list, the same on every rank, for gradient sync."""

    inputs: tuple[str, ...]  # model inputs, in call order
    stages: tuple[Stage, ...]
    projections: dict[str, tuple[str, int]]  # value → (stage value, tuple index)
    owner: dict[str, int]  # value → group index (INPUT for inputs)
    output: str  # the value the loss is computed on
    params_of_group: dict[int, list[tuple[str, nn.Parameter]]] = field(default_factory=dict)
    param_numels: dict[int, list[int]] = field(default_factory=dict)  # kept after detach_unheld
    param_names: dict[int, tuple[str, ...]] = field(default_factory=dict)
    param_numel: dict[str, int] = field(default_factory=dict)
    param_shape: dict[str, torch.Size] = field(default_factory=dict)  # as built (kept after detach_unheld)
    param_by_name: dict[str, nn.Parameter] = field(default_factory=dict)
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name → groups holding a copy
    unused: frozenset[str] = frozenset()  # parameters forward never reads (no gradient)
    no_grad: frozenset[str] = frozenset()  # values that cross with no gradient back (integer ids)
    warnings: list[str] = field(default_factory=list)
    split: bool = True  # False: the whole model is one stage

    def consumers(self, value: str) -> list[Stage]:
        return [s for s in self.stages if value in s.args]


def detach_unheld(flow: Dataflow, held_groups: set[int]) -> None:
    """Free the parameters of groups this rank does not hold (they were built for the seed),
    and list a tied parameter under only the first held group that uses it."""
    for g, ps in flow.params_of_group.items():
        flow.param_numels.setdefault(g, [p.numel() for _, p in ps])
    held_names = {n for g in held_groups for n, _ in flow.params_of_group.get(g, [])}
    listed: set[str] = set()
    for g in sorted(flow.params_of_group):
        keep = []
        for name, p in flow.params_of_group[g]:
            if g in held_groups:
                if name not in listed:
                    keep.append((name, p))
                    listed.add(name)
            elif name not in held_names:
                p.data = torch.empty(0, dtype=p.dtype)
                keep.append((name, p))
            # a tied copy this rank holds through another group is listed there
        flow.params_of_group[g] = keep
