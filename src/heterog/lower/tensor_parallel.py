"""A tensor-parallel plan as a Program: every member of a tensor-parallel set gets its own
instructions.

A replica with `tp_devices` splits its group's transformer blocks Megatron-style over its
members (ir/plan.py, cost/tensor_parallel.py). The members of a set compute the same samples
at the same time, each its slice of every split linear, with the per-block all-reduces
between them inside the computes (the executor's `tp_copy`/`tp_reduce` operators,
execute/tp_ops.py). So a tensor-parallel plan of degree t is t *sibling* plans run side by
side: sibling k places every replica on its set's k-th member, and the siblings meet only in
those per-block all-reduces. Everything between replicas stays within a sibling — gradient
syncs among the same-rank members of the replicas (Megatron's data-parallel groups), sends
between pipeline stages from each member to the same-rank member of the next stage.

The schedule is built on the first ranks (sibling 0, priced by the tensor-parallel cost model:
simulate/tensor_parallel.py) and the Program written from it is copied for each sibling k > 0
(`member_program`): devices mapped to the k-th members, its blocks appended as blocks of their
own (so every collective and transfer keeps one identity), ops and tags offset so that every
instruction id stays unique. A rank runs its sibling's part (`member_view`): a Program and a
Plan of that sibling alone (ranks keep their numbers; the other siblings' devices have no
instructions there), as if no tensor parallelism were there, plus where it sits in its set
(`MemberPlace`).

What the executor runs: one degree for every group (the siblings must be whole plans; stages
of different degrees are priced but not run), no parameter server. `runnable` says why not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from heterog.errors import PlanError
from heterog.ir.plan import Plan
from heterog.lower.program import Collective, Compute, Instruction, Program, Recv, Send


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberPlace:
    """Where a rank sits in its tensor-parallel set: member `index` of `members` (its set, in
    rank order), in sibling plan `index`; `siblings[k]` maps this sibling's devices to sibling
    k's (what a rank needs to create every sibling's process groups in one order)."""

    index: int
    members: tuple[str, ...]
    siblings: tuple[dict[str, str], ...]

    @property
    def degree(self) -> int:
        return len(self.members)

    @property
    def group_name(self) -> str:
        """The name its set's process group is registered under (execute/tp_ops.py)."""
        return "tp:" + ",".join(self.members)


def plan_degree(plan: Plan) -> int:
    return max((g.tp_degree for g in plan.groups), default=1)


def runnable(plan: Plan, what: str) -> Plan:
    """`plan`, or a PlanError saying why `what` cannot run its tensor parallelism."""
    if not plan.tensor_parallel:
        return plan
    degrees = sorted({g.tp_degree for g in plan.groups})
    if len(degrees) > 1:
        split = ", ".join(f"{g.name} (tp {g.tp_degree})" for g in plan.groups)
        raise PlanError(
            f"the plan's groups have tensor-parallel degrees {degrees} ({split}), and {what} runs one degree for "
            f"every group: the members of a set run a whole sibling plan each. `heterog simulate` and `heterog "
            f"report` price it; to run, give every stage the same --tp (--strategy 3d) or plan with "
            f"--no-tensor-parallel."
        )
    ps = [g.name for g in plan.groups if g.ps_device]
    if ps:
        raise PlanError(f"groups {ps} sync by a parameter server; {what} runs tensor-parallel plans with 'ring'.")
    return plan


def sibling_maps(plan: Plan) -> tuple[dict[str, str], ...]:
    """For each member index k, each first rank's k-th member (k = 0: the first ranks)."""
    t = plan_degree(plan)
    maps: tuple[dict[str, str], ...] = tuple({} for _ in range(t))
    for g in plan.groups:
        for r in g.replicas:
            for k, d in enumerate(r.members):
                maps[k][r.device] = d
    return maps


def sibling_plan(plan: Plan, index: int) -> Plan:
    """Sibling `index` of a tensor-parallel plan: every replica on its set's `index`-th member."""
    groups = tuple(
        dataclasses.replace(
            g, replicas=tuple(dataclasses.replace(r, device=r.members[index], tp_devices=()) for r in g.replicas)
        )
        for g in plan.groups
    )
    return dataclasses.replace(plan, groups=groups)


def op_stride(first: Program) -> int:
    """Sibling k's instructions are numbered k × this above the first ranks' (ids stay unique)."""
    return 1 + max((i.op for lst in first.instructions.values() for i in lst), default=0)


def member_program(
    first: Program, plan: Plan, devices: tuple[str, ...], regions: tuple[tuple[str, tuple[str, ...], str], ...]
) -> Program:
    """The Program of every member: `first` (written for the first ranks) and, for each sibling
    k > 0, its copy on the k-th members. devices: every rank's device, in rank order; regions:
    the split regions the cost model priced (norm, column linears, row linear), which the
    executor splits and no other."""
    runnable(plan, "the executor")
    maps = sibling_maps(plan)
    nb = len(first.blocks)
    ops = op_stride(first)
    tag_stride = 1 + max(
        (i.tag for lst in first.instructions.values() for i in lst if isinstance(i, (Send, Recv))), default=0
    )
    blocks = list(first.blocks)
    instructions: dict[str, tuple[Instruction, ...]] = dict(first.instructions)
    initial = dict(first.initial_bytes)
    for k, to in enumerate(maps[1:], start=1):
        shift = _Shift(to=to, blocks=k * nb, ops=k * ops, tags=k * tag_stride)
        blocks += [
            dataclasses.replace(b, devices=tuple(to[d] for d in b.devices), ps_device=None) for b in first.blocks
        ]
        for d, lst in first.instructions.items():
            instructions[to[d]] = tuple(shift.instruction(i) for i in lst)
            initial[to[d]] = first.initial_bytes.get(d, 0.0)
    return dataclasses.replace(
        first,
        devices=devices,
        blocks=tuple(blocks),
        instructions={d: instructions[d] for d in devices},
        initial_bytes={d: initial.get(d, 0.0) for d in devices},
        plan=plan.to_dict(),
        tp_regions=regions,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Shift:
    """Sibling k's copy of a first-rank instruction: devices mapped, blocks, ops and tags offset."""

    to: dict[str, str]
    blocks: int
    ops: int
    tags: int

    def tag(self, t: int | None) -> int | None:
        return None if t is None else t + self.tags

    def instruction(self, i: Instruction) -> Instruction:
        if isinstance(i, Compute):
            inputs = tuple(
                dataclasses.replace(p, block=p.block + self.blocks, tag=self.tag(p.tag), grad_tag=self.tag(p.grad_tag))
                for p in i.inputs
            )
            return dataclasses.replace(i, op=i.op + self.ops, block=i.block + self.blocks, inputs=inputs)
        if isinstance(i, (Send, Recv)):
            return dataclasses.replace(
                i, op=i.op + self.ops, tag=i.tag + self.tags, peer=self.to[i.peer],
                src_block=i.src_block + self.blocks, dst_block=i.dst_block + self.blocks,
            )  # fmt: skip
        if isinstance(i, Collective):
            return dataclasses.replace(
                i, op=i.op + self.ops, block=i.block + self.blocks, members=tuple(self.to[d] for d in i.members),
                nodes=tuple(tuple(self.to[d] for d in n) for n in i.nodes),
            )  # fmt: skip
        return dataclasses.replace(i, op=i.op + self.ops)


def member_view(program: Program, device: str) -> tuple[Program, Plan, MemberPlace | None]:
    """What `device` runs of `program`: its sibling's Program and Plan (blocks numbered from 0,
    ops and tags as in `program`), and its place in its set (None: no tensor parallelism)."""
    plan = Plan.from_dict(program.plan)
    if not plan.tensor_parallel:
        return program, plan, None
    maps = sibling_maps(plan)
    index = next(k for k, m in enumerate(maps) if device in m.values())
    inverse = {v: d for d, v in maps[index].items()}  # this sibling's device → its first rank
    members = tuple(m[inverse[device]] for m in maps)
    nb = len(program.blocks) // len(maps)
    mine = set(maps[index].values())
    back = -index * nb

    def local(i: Instruction) -> Instruction:
        if isinstance(i, Compute):
            inputs = tuple(dataclasses.replace(p, block=p.block + back) for p in i.inputs)
            return dataclasses.replace(i, block=i.block + back, inputs=inputs)
        if isinstance(i, (Send, Recv)):
            return dataclasses.replace(i, src_block=i.src_block + back, dst_block=i.dst_block + back)
        if isinstance(i, Collective):
            return dataclasses.replace(i, block=i.block + back)
        return i

    here = dataclasses.replace(  # rank r stays devices[r]; the other siblings' devices run nothing here
        program,
        blocks=program.blocks[index * nb : (index + 1) * nb],
        instructions={d: tuple(local(i) for i in lst) if d in mine else () for d, lst in program.instructions.items()},
        plan=sibling_plan(plan, index).to_dict(),
    )
    siblings = tuple({d: m[inverse[d]] for d in mine} for m in maps)
    return here, sibling_plan(plan, index), MemberPlace(index=index, members=members, siblings=siblings)


class TensorParallelSupport(StrEnum):
    """How far the planner may split groups by tensor parallelism."""

    NONE = "none"  # no group split
    UNIFORM = "uniform"  # every group at one degree, synced by ring: what `runnable` accepts
    ANY = "any"  # a degree per group, as the simulator prices it


def executor_tensor_parallel() -> TensorParallelSupport:
    """What planning for a run (the demo, an elastic run's re-plans, benchmarks/run_vs_sim.py)
    lets the search choose: the one switch. The executor runs UNIFORM plans (`runnable`); the
    plans chosen for runs are NONE until the emulated scenarios have run tensor-parallel
    plans the search chose, then UNIFORM."""
    return TensorParallelSupport.NONE


def refuse_tensor_parallel(plan: Plan, what: str) -> Plan:
    """`plan`, or a PlanError when it has tensor parallelism at all: `what` works on plans of
    whole blocks per device (a tensor-parallel plan is scheduled on its first ranks, by
    simulate/tensor_parallel.py and heterog.orchestrate.lowered)."""
    if plan.tensor_parallel:
        raise PlanError(
            f"{what} takes plans without tensor parallelism; a tensor-parallel plan is scheduled on its first "
            f"ranks (simulate/tensor_parallel.py first_ranks) and its Program copied for the members."
        )
    return plan
