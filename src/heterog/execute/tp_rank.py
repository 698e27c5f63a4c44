"""A rank of a tensor-parallel plan: its set's process group, its split model's slices, and
the parameters and optimizer state whole again (for checkpoints and parameter dumps).

The rank runs its sibling's Program (lower/tensor_parallel.py `member_view`); this module holds
what differs from a rank of a plan without tensor parallelism:
- every set's process group, created on every rank in the plan's order (creating a group is
  collective over the default group), its own registered for the operators (tp_ops.py);
- the process groups of the other siblings' syncs and transfers, which this rank must create
  too, in one order on every rank: `sibling_ranks` maps each rank of this sibling to the same
  rank in every sibling;
- which parameters are slices (`TensorParallelState`), so that a member other than the first
  counts only those in the gradient norm and reports no loss (its first member's is the same),
  and a checkpoint holds every parameter whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from heterog.execute.tp_ops import group_of, register_group, time_with
from heterog.execute.tp_split import ParameterSlice, TensorParallelRank
from heterog.ir.plan import Plan
from heterog.lower.tensor_parallel import MemberPlace


def join_sets(whole: Plan, place: MemberPlace | None, rank_of: dict[str, int], timeout_s: float):
    """Create every tensor-parallel set's process group (on every rank, in the plan's order) and
    register this rank's; its TensorParallelRank, or None without tensor parallelism."""
    if not whole.tensor_parallel:
        return None
    seen: dict[tuple[str, ...], None] = {}
    for g in whole.groups:
        for r in g.replicas:
            seen.setdefault(r.members, None)
    assert place is not None, "a rank of a tensor-parallel plan has a place in its set"
    for members in seen:
        group = dist.new_group(ranks=sorted(rank_of[d] for d in members), timeout=timedelta(seconds=timeout_s))
        if members == place.members:
            register_group(place.group_name, group)
    return TensorParallelRank(index=place.index, degree=place.degree, group=place.group_name)


def sibling_ranks(place: MemberPlace | None, rank_of: dict[str, int]) -> list[dict[int, int]]:
    """For every sibling in order, this sibling's ranks → that sibling's ranks (identity alone
    without tensor parallelism)."""
    if place is None:
        return []
    return [{rank_of[d]: rank_of[to] for d, to in m.items()} for m in place.siblings]


@dataclass(kw_only=True)
class TensorParallelState:
    """The rank's tensor-parallel slices: which parameters are cut, and how."""

    tp: TensorParallelRank
    cut: dict[str, ParameterSlice] = field(default_factory=dict)

    @property
    def first(self) -> bool:
        return self.tp.index == 0

    def attach(self, interpreter) -> None:
        """Make the rank's interpreter a member's: the loss reported by the first member alone,
        each all-reduce of the split blocks a measured span of the step."""
        interpreter.reports_loss = self.first
        time_with(interpreter.clock, interpreter.tp_marks)

    @property
    def counted(self) -> set[str] | None:
        """The parameters this member counts in the gradient norm: all on the first member,
        the slices alone on the others (the whole parameters are alike on every member)."""
        return None if self.first else set(self.cut)

    def group(self) -> dist.ProcessGroup:
        return group_of(self.tp.group)

    def whole(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` (this member's slice of parameter `name`, or a state tensor shaped like it)
        made whole from every member's (collective over the set)."""
        sl = self.cut.get(name)
        if sl is None or value.dim() <= sl.dim or value.shape[sl.dim] != sl.full // self.tp.degree:
            return value  # not cut (whole, or a scalar such as AdamW's step)
        parts = [torch.empty_like(value) for _ in range(self.tp.degree)]
        dist.all_gather(parts, value.contiguous(), group=self.group())
        return sl.assemble(parts)

    def mine(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This member's slice of the whole `name` (or of a state tensor shaped like it)."""
        sl = self.cut.get(name)
        if sl is None or whole.dim() <= sl.dim or whole.shape[sl.dim] != sl.full:
            return whole
        return sl.take(whole, self.tp.index, self.tp.degree)

    def whole_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        sl = self.cut.get(name)
        if sl is None:
            return shape
        return tuple(sl.full if i == sl.dim else s for i, s in enumerate(shape))
