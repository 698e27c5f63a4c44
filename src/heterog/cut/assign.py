"""Which group each node of an exported model runs in, and where the stages are cut.

The rules (leaf calls by name, loose runs by parent and index, otherwise a loose node with
its latest producer, or its earliest consumer; the group-major order; a stage per run of
one placement) are described in partition.py's docstring, which uses them.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from torch import fx

from heterog.cut.split_export import ExportedModel
from heterog.errors import PlanError
from heterog.ir.plan import Plan


def group_of_names(plan: Plan) -> dict[str, int]:
    """Capture node name → index of the plan group that holds it."""
    return {name: i for i, g in enumerate(plan.groups) for name in g.nodes}


def _group_of_loose_runs(plan: Plan) -> dict[tuple[str, int], int]:
    """(parent, k) → group of the plan's loose-run node '<parent>::<op>@k'."""
    out: dict[tuple[str, int], int] = {}
    for gi, g in enumerate(plan.groups):
        for name in g.nodes:
            parent, sep, rest = name.partition("::")
            k = rest.rpartition("@")[2]
            if sep and k.isdigit():
                out[(parent, int(k))] = gi
    return out


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupOrder:
    """Where the groups run: `pos[g]`, group g's position in the order; `block[g]`, the
    Program block that runs it (a stage then never spans two blocks), or None when no
    Program is given (a stage is then a run of one placement)."""

    pos: tuple[int, ...]
    block: tuple[int, ...] | None = None


def group_order_of(plan: Plan, order: Sequence[int] | Sequence[Sequence[int]] | None = None) -> GroupOrder:
    """The GroupOrder from the Program's blocks (groups per block, in order:
    partition.program_group_order), from a flat order of the groups, or the plan's order."""
    n = len(plan.groups)
    blocks = None
    if order is None:
        flat = list(range(n))
    elif order and not isinstance(order[0], int):
        blocks = [list(cast(Sequence[int], b)) for b in order]
        flat = [g for b in blocks for g in b]
    else:
        flat = [cast(int, g) for g in order]
    if sorted(flat) != list(range(n)):
        raise PlanError(
            f"the group order {list(order or [])} is not an order of the plan's {n} groups; "
            f"lower the plan again so that the Program and the plan agree."
        )
    pos = [0] * n
    for i, g in enumerate(flat):
        pos[g] = i
    block = None
    if blocks is not None:
        block_of = [0] * n
        for bi, b in enumerate(blocks):
            for g in b:
                block_of[g] = bi
        block = tuple(block_of)
    return GroupOrder(pos=tuple(pos), block=block)


def assign_groups(
    exported: ExportedModel, plan: Plan, pos: Sequence[int] | None = None
) -> tuple[dict[fx.Node, int], list[str]]:
    """Every data node → group index, by the rule in the module docstring (`pos`: each
    group's position in the group order). Nodes that do not depend on input data are left
    out: they are recomputed where needed (cut_rewrite.py)."""
    pos = group_order_of(plan).pos if pos is None else pos
    by_name = group_of_names(plan)
    calls = list(dict.fromkeys(exported.leaf_name.values()))
    unmatched = [name for name in calls if name not in by_name]
    warnings: list[str] = []
    if calls and len(unmatched) == len(calls):
        raise PlanError(
            f"none of the model's {len(calls)} module calls (e.g. {calls[0]!r}) is "
            f"named in the plan's groups (e.g. {plan.groups[0].nodes[:2]}); the plan "
            f"was made for a different model. Re-plan for {plan.model.name!r}."
        )
    if unmatched:
        warnings.append(
            f"{len(unmatched)} module call(s) not named in the plan follow their producer's group, e.g. {unmatched[:3]}"
        )
    compute = [n for n in _compute_nodes(exported.module) if n in exported.data]
    assign = {n: by_name[exported.leaf_name[n]] for n in compute if exported.leaf_name.get(n) in by_name}
    named = set(assign)
    by_run = _group_of_loose_runs(plan)
    for n in compute:  # rule 0: a loose run the plan names
        if n not in assign and exported.loose_run.get(n) in by_run:
            assign[n] = by_run[exported.loose_run[n]]
    for n in compute:  # rule 1: the latest producer
        if n not in assign:
            inputs = [assign[a] for a in n.all_input_nodes if a in assign]
            if inputs:
                assign[n] = max(inputs, key=lambda g: pos[g])
    for n in reversed(compute):  # rule 2: the earliest consumer
        if n not in assign:
            users = [assign[u] for u in n.users if u in assign]
            if users:
                assign[n] = min(users, key=lambda g: pos[g])
    for n in compute:  # rule 3: dead code
        assign.setdefault(n, 0)
    for n in compute:  # no loose node before its inputs (export order is topological)
        inputs = [assign[a] for a in n.all_input_nodes if a in assign]
        if n not in named and inputs:
            latest = max(inputs, key=lambda g: pos[g])
            if pos[latest] > pos[assign[n]]:
                assign[n] = latest
    return assign, warnings


def group_major_order(compute: list[fx.Node], assign: dict[fx.Node, int], pos: Sequence[int]) -> list[fx.Node]:
    """A topological order of the assigned nodes that runs the nodes of earlier groups first
    (Kahn's algorithm keyed by (group position, traced index)): with every edge pointing to
    the same or a later group, each group's nodes are consecutive."""
    nodes = [n for n in compute if n in assign]
    index = {n: i for i, n in enumerate(nodes)}
    indeg = {n: sum(1 for a in set(n.all_input_nodes) if a in index) for n in nodes}
    heap = [(pos[assign[n]], index[n]) for n in nodes if indeg[n] == 0]
    heapq.heapify(heap)
    out: list[fx.Node] = []
    while heap:
        n = nodes[heapq.heappop(heap)[1]]
        out.append(n)
        for u in n.users:
            if u in index:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, (pos[assign[u]], index[u]))
    assert len(out) == len(nodes), "the exported graph has a cycle"
    return out


def segments(
    order: list[fx.Node], assign: dict[fx.Node, int], plan: Plan, go: GroupOrder | None = None
) -> dict[fx.Node, int]:
    """Data node → stage index. With the Program's blocks, a new stage starts wherever the
    block changes; without, wherever the placement changes, or where the order skips over a
    group (one with no node of its own here) of another placement. A getitem stays with the
    node it unpacks (a tuple never crosses a cut)."""
    go = go or group_order_of(plan)
    pos = go.pos
    by_pos = sorted(range(len(plan.groups)), key=lambda g: pos[g])
    seg: dict[fx.Node, int] = {}
    current, last_pos = -1, None
    last: object = None  # the block, or the placement, of the last node
    for n in order:
        if n.target is operator.getitem and n.args[0] in seg:
            seg[n] = seg[cast(fx.Node, n.args[0])]
            continue
        g = assign[n]
        if go.block is not None:
            new = go.block[g] != last
            last = go.block[g]
        else:
            placement = plan.groups[g].replicas
            skipped: list[int] = [] if last_pos is None or pos[g] <= last_pos else by_pos[last_pos + 1 : pos[g]]
            new = placement != last or any(plan.groups[k].replicas != placement for k in skipped)
            last = placement
        current += new
        seg[n] = current
        last_pos = pos[g]
    return seg
