"""Where the split model's stages meet the Program's blocks, read once per rank before the
first step: which stages a block runs and at which compute, and which values cross between
two blocks (the same order on every rank, so a transfer's messages line up)."""

from __future__ import annotations

from heterog.cut.dataflow import INPUT, Dataflow
from heterog.errors import PlanError
from heterog.execute.transport import MAX_VALUES
from heterog.ir.kinds import Phase
from heterog.lower.program import Compute, Program


def unit_of(ins: Compute, n_microbatches: int) -> int:
    """The key of what a compute runs on: its micro-batch, or for a later piece of a replica
    that accumulates (ir/accumulation.py) a number of its own past the micro-batches, so each
    piece keeps its own values, gradient slots and saved calls. Piece 0 is its micro-batch,
    the number transfers use."""
    return ins.microbatch + ins.piece * n_microbatches


def stages_of_blocks(program: Program, flow: Dataflow, instructions):
    """(block → its stages, (stage, phase, unit_of) → index of the compute that runs it,
    block → its run). A stage may span several blocks only if they are consecutive and share
    one placement (a fused run cut into gradient buckets); it runs at the first of their
    computes in this rank's program, and those blocks form one run."""
    block_of = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
    stages_of: dict[int, list[int]] = {}
    run_of = list(range(len(program.blocks)))
    for si, s in enumerate(flow.stages):
        blocks = sorted({block_of[g] for g in (s.groups or (s.group,))})
        placements = {(program.blocks[b].devices, program.blocks[b].shares) for b in blocks}
        if len(placements) > 1 or blocks != list(range(blocks[0], blocks[-1] + 1)):
            raise PlanError(
                f"stage {s.value!r} of the split model runs groups of blocks {blocks}, which "
                f"are not one run of a single placement; the model cannot be cut as planned."
            )
        for b in blocks:
            stages_of.setdefault(b, []).append(si)
            run_of[b] = run_of[blocks[0]]
    first: dict[tuple[int, Phase, int], int] = {}  # (stage, phase, unit_of) → compute index
    for index, ins in enumerate(instructions):
        if isinstance(ins, Compute):
            for si in stages_of.get(ins.block, ()):
                first.setdefault((si, ins.phase, unit_of(ins, len(program.microbatch_sizes))), index)
    return stages_of, first, run_of


def crossing_values(program: Program, flow: Dataflow) -> dict[tuple[int, int], list[str]]:
    """(producer block, consumer block) → the values that move between them, in a fixed order
    (the same on every rank: the order of the split's stages and their arguments)."""
    block_of = {g: b for b, blk in enumerate(program.blocks) for g in blk.groups}
    out: dict[tuple[int, int], list[str]] = {}
    for s in flow.stages:
        consumers = sorted({block_of[g] for g in (s.groups or (s.group,))})
        for v in s.args:
            owner = flow.owner[v]
            if owner == INPUT:
                continue
            a = block_of[owner]
            for b in consumers:
                if a == b:
                    continue
                lst = out.setdefault((a, b), [])
                if v not in lst:
                    if len(lst) >= MAX_VALUES:
                        raise PlanError(
                            f"more than {MAX_VALUES} values cross from block {a} to block "
                            f"{b}; group the model more coarsely."
                        )
                    lst.append(v)
    return out
