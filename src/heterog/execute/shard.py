"""Sharded state on one rank (ZeRO-1/2/3): the pieces it holds, and what the Program's
reduce-scatters and all-gathers of sharded blocks do with them. The rules — layout, which
collective runs when, what lives how long — are the lowering's (lower/shard_tasks.py); this
module carries them out.

A sharded block's parameters (its groups' parameters in a fixed order, the same on every rank;
tied and unused ones left whole, as in its gradient bucket, sync.py) form one flat buffer, and
the member at ring position i owns elements `shard_ranges(numel, shards)[i]`. The optimizer
steps that piece (`ShardUnit.piece`), which has its own gradient, cut where its parameters
meet (`ShardUnit.subs`, views of it and of its gradient): the run's optimizer factory chose
each parameter's group by the parameter as the model holds it (`make_optimizer`), so a cut
steps with its own parameter's hyperparameters (DeepSpeed's ZeRO keeps the client's groups
apart likewise: one flat partition per group, deepspeed/runtime/zero/stage_1_and_2.py):
- stages 1–2: the flat buffer holds all parameters and the model's parameters are views of
  it, the piece too, so the optimizer updates the model in place; the all-gather after the
  step fills in the other members' pieces, in place;
- stage 3: the rank keeps only its piece; an all-gather before a compute builds the full
  buffer, the parameters become views of it for that compute (`materialise`) and are emptied
  after it (`release`). Autograd saved the parameters themselves, not their storage, so the
  backward's gather makes them whole again for the backward.
A reduce-scatter sums the gradients into the piece's (added, under stage 3, micro-batch after
micro-batch); stage 2 and 3 free the gradients when it starts.

Why not torch's FSDP2 (`fully_shard`): it shards every parameter evenly along dim 0
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `_chunk_with_empty`, the first chunk
padded) and issues its collectives from module hooks, while a plan gives replicas uneven
pieces and the Program says when each collective runs. The ring halves (collectives.py) run
on the same sub-groups, lane and tags as the all-reduces.

Checkpoints stay keyed by parameter name (checkpoint.py): for each block the members gather
the parameters and optimizer state, and each parameter is written by the member holding most
of it (`owner`); on resume each member reads the parameters that overlap its piece and keeps
its slice, whatever plan wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from heterog.cut.dataflow import Dataflow
from heterog.errors import PlanError
from heterog.execute.collectives import ring_all_gather, ring_reduce_scatter
from heterog.ir.kinds import CollectiveOp, Phase, ShardStage
from heterog.ir.plan import shard_ranges
from heterog.lower.program import Collective, Program
from heterog.training import Recipe


@dataclass(kw_only=True)
class ShardUnit:
    """A sharded block this rank is a member of."""

    block: int
    stage: int
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    shapes: tuple[torch.Size, ...]
    members: tuple[int, ...]  # ranks, ring order
    ranges: tuple[tuple[int, int], ...]  # each member's piece of the flat buffer, ring order
    piece: nn.Parameter  # this rank's piece of the flat buffer, with the summed gradient
    flat: torch.Tensor | None = None  # stages 1–2: every parameter (the model's are views)
    # the piece cut where its parameters meet: (parameter index, start, end in the piece), and
    # a view of the piece for each, what the optimizer steps (`make_optimizer`)
    cuts: tuple[tuple[int, int, int], ...] = ()
    subs: tuple[nn.Parameter, ...] = ()
    gathered: dict[tuple[Phase, int], tuple[torch.Tensor, Any]] = field(default_factory=dict)

    @property
    def sizes(self) -> list[int]:
        return [hi - lo for lo, hi in self.ranges]

    @property
    def mine(self) -> tuple[int, int]:
        return self.ranges[self.members.index(torch.distributed.get_rank())]

    def offsets(self) -> list[int]:
        out, at = [], 0
        for shape in self.shapes:
            out.append(at)
            at += shape.numel()
        return out

    def show(self, flat: torch.Tensor) -> None:
        """Make the parameters views of `flat` (all of them)."""
        for p, shape, at in zip(self.params, self.shapes, self.offsets()):
            p.data = flat[at : at + shape.numel()].view(shape)

    def hide(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def owner(self, index: int) -> int:
        """The member (rank) that writes parameter `index` to a checkpoint: the one holding
        most of it, the first in ring order on a tie."""
        at = self.offsets()[index]
        end = at + self.shapes[index].numel()
        overlap = [max(0, min(hi, end) - max(lo, at)) for lo, hi in self.ranges]
        return self.members[overlap.index(max(overlap))]


def unit_names(flow: Dataflow, groups: Sequence[int]) -> tuple[str, ...]:
    """The parameters a block's groups shard: its gradient bucket's (sync.py)."""
    return tuple(n for g in groups for n in flow.param_names.get(g, ()) if n not in flow.tied and n not in flow.unused)


def sharded_collectives(program: Program) -> dict[int, Collective]:
    """One reduce-scatter or all-gather of each sharded block (its members and pieces)."""
    out: dict[int, Collective] = {}
    for device in program.devices:
        for ins in program.instructions.get(device, ()):
            if isinstance(ins, Collective) and ins.primitive is not CollectiveOp.ALL_REDUCE:
                out.setdefault(ins.block, ins)
    return out


class ShardRunner:
    """The sharded blocks of this rank and their collectives (launched by sync.ProgramSync on
    the BucketRunner's lane)."""

    def __init__(self, *, program: Program, flow: Dataflow, rank: int, rank_of: dict[str, int], runner: Any):
        self.rank, self.runner = rank, runner
        self.units: dict[int, ShardUnit] = {}
        for b, ins in sorted(sharded_collectives(program).items()):
            members = tuple(rank_of[d] for d in ins.members)
            if rank in members:
                self.units[b] = self._unit(program, flow, b, ins, members)
        self._deferred: list[tuple[Collective, int | None]] = []

    @staticmethod
    def _unit(program: Program, flow: Dataflow, b: int, ins: Collective, members: tuple[int, ...]) -> ShardUnit:
        block = program.blocks[b]
        names = unit_names(flow, block.groups)
        params = tuple(flow.param_by_name[n] for n in names)
        shapes = tuple(flow.param_shape[n] for n in names)
        ranges = tuple(shard_ranges(sum(s.numel() for s in shapes), ins.shards))
        lo, hi = ranges[members.index(torch.distributed.get_rank())]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
        unit = ShardUnit(
            block=b,
            stage=block.shard_stage,
            names=names,
            params=params,
            shapes=shapes,
            members=members,
            ranges=ranges,
            piece=nn.Parameter(flat[lo:hi] if block.shard_stage < ShardStage.PARAMETERS else flat[lo:hi].clone()),
        )
        if unit.stage < ShardStage.PARAMETERS:
            unit.flat = flat
            unit.show(flat)
        else:
            unit.hide()
        if names:
            ends = [(i, at, at + s.numel()) for i, (s, at) in enumerate(zip(shapes, unit.offsets()))]
            # an empty piece is stepped too: every member then keeps the same optimizer state keys
            cuts = [(i, max(lo, a) - lo, min(hi, b) - lo) for i, a, b in ends if a < hi and b > lo] or [(0, 0, 0)]
            unit.cuts = tuple(cuts)
            unit.subs = tuple(nn.Parameter(unit.piece.data[a:b]) for _, a, b in cuts)
        return unit

    # -- what the rest of the rank needs ------------------------------------------------------
    def pieces(self, only: set[str] | None = None) -> list[nn.Parameter]:
        """What the optimizer steps: each piece cut where its parameters meet (`only`: the cuts
        of these parameters)."""
        return [
            sub
            for u in self.units.values()
            for sub, (i, _, _) in zip(u.subs, u.cuts)
            if only is None or u.names[i] in only
        ]

    def stand_ins(self, *, whole: bool = False) -> list[tuple[nn.Parameter, nn.Parameter | None]]:
        """Per cut of a piece: a stand-in of its parameter as the model holds it (its shape and
        dtype, no memory: one element expanded), and the cut; `whole`: of every parameter of
        the sharded blocks, each once (no cut)."""

        def stand_in(u: ShardUnit, i: int) -> nn.Parameter:
            return nn.Parameter(torch.empty((), dtype=u.piece.dtype, device=u.piece.device).expand(u.shapes[i]))

        if whole:
            return [(stand_in(u, i), None) for u in self.units.values() for i in range(len(u.names))]
        return [(stand_in(u, i), sub) for u in self.units.values() for sub, (i, _, _) in zip(u.subs, u.cuts)]

    def sharded_names(self) -> set[str]:
        return {n for u in self.units.values() for n in u.names}

    def hidden_names(self) -> set[str]:
        """Parameters this rank does not hold whole between computes (stage 3)."""
        return {n for u in self.units.values() if u.stage >= ShardStage.PARAMETERS for n in u.names}

    def model_params(self) -> list[nn.Parameter]:
        """The model's parameters of sharded blocks and the whole pieces: not stepped, their
        gradients cleared each step."""
        return [p for u in self.units.values() for p in (*u.params, u.piece)]

    def live_tensors(self) -> list[torch.Tensor]:
        """Gathered parameters (stage 3) and the flat buffers, for the memory count."""
        out = [u.flat for u in self.units.values() if u.flat is not None]
        return out + [t for u in self.units.values() for t, _ in u.gathered.values()]

    def check_stages(self, stages_of: dict[int, list[int]]) -> None:
        """A stage-3 block's parameters are gathered for its own computes only, so no stage of
        the split may run it together with another block."""
        blocks_of: dict[int, set[int]] = {}
        for b, stages in stages_of.items():
            for si in stages:
                blocks_of.setdefault(si, set()).add(b)
        for b, u in self.units.items():
            others = {x for si in stages_of.get(b, ()) for x in blocks_of[si]} - {b}
            if u.stage >= ShardStage.PARAMETERS and others:
                raise PlanError(
                    f"block {b} shards its parameters (stage 3), but the split runs it in one stage "
                    f"with block(s) {sorted(others)}: their parameters could not be gathered apart. "
                    f"Shard it at stage 2, or group the model so that the cut falls between them."
                )

    # -- the collectives ---------------------------------------------------------------------
    def launch(self, ins: Collective, index: int | None = None, *, deferred: bool = False) -> None:
        """A sharded block's reduce-scatter or all-gather as the Program reaches it (at `index`
        in this rank's list: its run is timed as that instruction). With `deferred` (fp16:
        the optimizer steps at the end of the step, after the loss-scale check) a gather of
        updated pieces waits for `launch_deferred`."""
        unit = self.units.get(ins.block)
        if unit is None or not unit.names:
            self.runner.nothing_to_run(f"{ins.block} {ins.primitive}", index)
        elif ins.primitive is CollectiveOp.REDUCE_SCATTER:
            self._reduce_scatter(unit, index)
        elif ins.phase is not None:
            self._gather_for(unit, ins.phase, ins.microbatch, index)
        elif deferred:
            self._deferred.append((ins, index))
        else:
            self.runner.submit(f"{unit.block} all-gather", unit.members, index, self._all_gather, unit.flat, unit)

    def launch_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for ins, index in deferred:
            self.launch(ins, index)

    def _reduce_scatter(self, unit: ShardUnit, index: int | None) -> None:
        grads = [
            (p.grad if p.grad is not None else torch.zeros(s, device=unit.piece.device)).detach().reshape(-1)
            for p, s in zip(unit.params, unit.shapes)
        ]
        flat = torch.cat(grads)
        if unit.stage >= ShardStage.GRADIENTS:  # the flat copy holds them now
            for p in unit.params:
                p.grad = None
        self.runner.submit(f"{unit.block} reduce-scatter", unit.members, index, self._sum_into_piece, flat, unit)

    def _sum_into_piece(self, flat: torch.Tensor, unit: ShardUnit) -> None:
        """On the lane: reduce-scatter `flat` and add this rank's summed piece to the piece's
        gradient (which owns its storage: the flat buffer goes when this returns)."""
        ring_reduce_scatter(flat, unit.sizes, unit.members, self.runner.groups.link(unit.members))
        lo, hi = unit.mine
        mine = flat[lo:hi]
        if unit.piece.grad is None:
            unit.piece.grad = mine.clone()
        else:
            unit.piece.grad.add_(mine)
        for sub, (_, a, b) in zip(unit.subs, unit.cuts):
            sub.grad = unit.piece.grad[a:b]

    def _all_gather(self, flat: torch.Tensor, unit: ShardUnit) -> torch.Tensor:
        ring_all_gather(flat, unit.sizes, unit.members, self.runner.groups.link(unit.members))
        return flat

    def _gather_for(self, unit: ShardUnit, phase: Phase, microbatch: int | None, index: int | None) -> None:
        lo, hi = unit.mine
        full = torch.empty(sum(unit.sizes), dtype=unit.piece.dtype, device=unit.piece.device)
        full[lo:hi].copy_(unit.piece.detach())
        job = self.runner.submit(
            f"{unit.block} all-gather {phase} mb{microbatch}", unit.members, index, self._all_gather, full, unit
        )
        unit.gathered[(phase, microbatch or 0)] = (full, job)

    def materialise(self, block: int, phase: Phase, microbatch: int) -> None:
        """Before a compute of a stage-3 block: wait for its gather, show the parameters."""
        unit = self.units.get(block)
        if unit is None or unit.stage < ShardStage.PARAMETERS or not unit.names:
            return
        entry = unit.gathered.get((phase, microbatch))
        if entry is None:
            raise PlanError(
                f"the {phase} of block {block}, micro-batch {microbatch}, runs before the gather of its "
                f"parameters was launched; re-lower the plan (`heterog lower`)."
            )
        full, job = entry
        self.runner.wait(job)
        unit.show(full)

    def release(self, block: int, phase: Phase, microbatch: int) -> None:
        """After that compute: the gathered parameters go."""
        unit = self.units.get(block)
        if unit is None or unit.stage < ShardStage.PARAMETERS:
            return
        unit.gathered.pop((phase, microbatch), None)
        unit.hide()

    # -- checkpoints and dumps -------------------------------------------------------------------
    def full_state(self, optimizer: torch.optim.Optimizer | None, *, with_params: bool) -> dict[str, Any]:
        """Checkpoint entries this rank writes: for each parameter it owns, `model/<name>`
        (`with_params`, or always under stage 3) and its optimizer state `optim/<name>/<key>`,
        gathered from the members. Every member calls this (collective per block)."""
        out: dict[str, Any] = {}
        for unit in self.units.values():
            if not unit.names:
                continue
            gathered = {}
            if with_params or unit.stage >= ShardStage.PARAMETERS:
                gathered["model"] = self._gather_piece(unit, unit.piece.detach())
            state = piece_state(optimizer, unit)
            for key in sorted(state):  # the same keys, in the same order, on every member
                value = state[key]
                if isinstance(value, torch.Tensor):
                    gathered[key] = value if value.dim() == 0 else self._gather_piece(unit, value)
            for i, (name, shape, at) in enumerate(zip(unit.names, unit.shapes, unit.offsets())):
                if unit.owner(i) != self.rank:
                    continue
                for key, full in gathered.items():
                    piece = full if full.dim() == 0 else full[at : at + shape.numel()].view(shape)
                    out[f"model/{name}" if key == "model" else f"optim/{name}/{key}"] = piece.clone()
        return out

    def _gather_piece(self, unit: ShardUnit, piece: torch.Tensor) -> torch.Tensor:
        """A full flat buffer from every member's piece (run now, on this thread)."""
        lo, hi = unit.mine
        full = torch.empty(sum(unit.sizes), dtype=piece.dtype, device=piece.device)
        full[lo:hi].copy_(piece.reshape(-1))
        return self._all_gather(full, unit)

    def load(self, read: Any, optimizer: torch.optim.Optimizer | None, state_device: Any) -> None:
        """Resume: each unit's parameters (stage 3) and optimizer state from full per-name
        tensors, of which this rank keeps its slice. `read` (checkpoint._Reader) lists a
        parameter's state keys, makes empty tensors shaped as the checkpoint holds them and
        fills a dict of them; `state_device(key, piece)` says where a state entry lives."""
        for unit in self.units.values():
            if unit.names:
                self._load_unit(unit, read, optimizer, state_device)

    def _load_unit(self, unit: ShardUnit, read: Any, optimizer: Any, state_device: Any) -> None:
        lo, hi = unit.mine
        overlap = [
            (name, shape, at)
            for name, shape, at in zip(unit.names, unit.shapes, unit.offsets())
            if at < hi and at + shape.numel() > lo
        ]
        first = unit.names[0]  # scalar state (AdamW's step) is the same for every parameter
        keys = read.keys_of(first) if optimizer is not None else []
        entries: dict[str, torch.Tensor] = {}
        for name, shape, _ in overlap:
            if unit.stage >= ShardStage.PARAMETERS:
                entries[f"model/{name}"] = torch.empty(shape, dtype=unit.piece.dtype, device=unit.piece.device)
            for key in keys:
                entries[f"optim/{name}/{key}"] = read.empty(f"optim/{name}/{key}", state_device(key, unit.piece))
        for key in keys:
            entries.setdefault(
                f"optim/{first}/{key}", read.empty(f"optim/{first}/{key}", state_device(key, unit.piece))
            )
        if entries:
            read(entries)
        with torch.no_grad():
            if unit.stage >= ShardStage.PARAMETERS:
                _fill(unit.piece.data, overlap, lo, entries, "model/{}")
            state = {}
            for key in keys:
                like = entries[f"optim/{first}/{key}"]
                if like.dim() == 0:
                    state[key] = like
                else:
                    state[key] = torch.empty(hi - lo, dtype=like.dtype, device=like.device)
                    _fill(state[key], overlap, lo, entries, f"optim/{{}}/{key}")
            for sub, (_, a, b) in zip(unit.subs, unit.cuts) if state else ():  # each its own copy, `step` too
                optimizer.state[sub] = {k: (v if v.dim() == 0 else v[a:b]).clone() for k, v in state.items()}


def piece_state(optimizer: torch.optim.Optimizer | None, unit: ShardUnit) -> dict[str, torch.Tensor]:
    """The optimizer state of a unit's piece: its cuts' joined (a scalar, e.g. `step`: the first's)."""
    states = [optimizer.state.get(sub, {}) for sub in unit.subs] if optimizer is not None else []
    if not states:
        return {}
    return {
        key: value if value.dim() == 0 else torch.cat([st[key].reshape(-1) for st in states])
        for key, value in states[0].items()
        if isinstance(value, torch.Tensor)
    }


def make_optimizer(recipe: Recipe, params: list[nn.Parameter], shards: ShardRunner) -> torch.optim.Optimizer | None:
    """The run's optimizer (training.Recipe) over this rank's whole parameters `params` and its
    pieces' cuts. The recipe's factory is given each sharded parameter as the model holds it
    (a stand-in of its shape that holds no memory), so its parameter groups and
    hyperparameters are those one process gets (a user's factory may group by dimension);
    each cut then steps in its parameter's group."""
    pairs = shards.stand_ins()
    cut_of = {id(stand): [sub] for stand, sub in pairs if sub is not None}
    stand_ins = [stand for stand, _ in pairs]
    opt = recipe.make_optimizer(params + stand_ins)
    if opt is not None and stand_ins:
        for group in opt.param_groups:
            group["params"] = [q for p in group["params"] for q in cut_of.get(id(p), [p])]
    return opt


def _fill(target: torch.Tensor, overlap, lo: int, entries: dict[str, torch.Tensor], key: str) -> None:
    """Copy into `target` (the piece starting at `lo` of a flat buffer) the part of each
    overlapping parameter's full tensor (entries[key.format(name)]) that falls in it."""
    hi = lo + target.numel()
    for name, shape, at in overlap:
        a, b = max(lo, at), min(hi, at + shape.numel())
        target[a - lo : b - lo].copy_(entries[key.format(name)].reshape(-1)[a - at : b - at])


# -- the rank's parameters (execute/worker.py) ---------------------------------------------------
def rank_parameters(
    recipe: Recipe, named: list[tuple[str, nn.Parameter]], shards: ShardRunner
) -> tuple[torch.optim.Optimizer | None, list[nn.Parameter], list[tuple[str, nn.Parameter]]]:
    """A rank's optimizer (the run's: over its whole parameters and its pieces' cuts,
    `make_optimizer`), the parameters whose gradients are cleared every step (those, the whole
    pieces and the sharded blocks' model parameters), and its named parameters held whole
    between computes (all but stage 3's: what checkpoints and dumps read by name)."""
    sharded, hidden = shards.sharded_names(), shards.hidden_names()
    whole = [p for n, p in named if n not in sharded]
    opt = make_optimizer(recipe, whole, shards)
    params = whole + shards.pieces() + shards.model_params()
    return opt, params, [(n, p) for n, p in named if n not in hidden]


def as_held(named: list[tuple[str, nn.Parameter]], shards: ShardRunner) -> list[nn.Parameter] | None:
    """A rank's parameters as the model holds them, for the record's optimizer groups: its
    sharded blocks' whole, by stand-ins of their shapes (as `make_optimizer` made its
    optimizer); None when it holds none."""
    sharded = shards.sharded_names()
    return [p for n, p in named if n not in sharded] + [st for st, _ in shards.stand_ins(whole=True)] or None


def whole_parameters(named: list[tuple[str, nn.Parameter]], shards: ShardRunner) -> dict[str, torch.Tensor]:
    """A rank's parameters by name, copied to the CPU, with those of its stage-3 blocks that it
    owns gathered from the members (every member calls this: collective per block)."""
    gathered = shards.full_state(None, with_params=False)
    held = {n: p.detach() for n, p in named} | {k.removeprefix("model/"): v for k, v in gathered.items()}
    return {n: t.to("cpu").clone() for n, t in held.items()}
