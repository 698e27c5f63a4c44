"""The Program: a Plan lowered to one ordered list of typed instructions per device.

What the executor carries out and the simulator times (lower/lowering.py writes it from the
schedule). Devices are ranks: rank r runs `instructions[devices[r]]` in order. Instructions:
  Compute     forward or backward of a block (a fused run of groups with one placement) on
              samples [lo, hi) of a micro-batch; `inputs` says where each piece of its input
              comes from (this device's own earlier output, or a Recv by tag)
  Send/Recv   samples [lo, hi) of a block's outputs (forward) or of their gradients
              (backward) to/from a peer; a pair shares a tag
  Collective  a gradient bucket (one replicated block) over its members: ring, tree,
              hierarchical or a parameter server; members in ring order. With `tie` set, the
              gradient of a tied parameter whose users lie in several groups, summed over
              every device holding a copy (ring); `block` is then its owner's block.
              A sharded block's (lower/shard_tasks.py) are a ring reduce-scatter of its
              gradients and an all-gather of its parameters (`primitive`), member i owning the piece
              `shards[i]` of the flat buffer; with `phase` and `microbatch` set (stage 3) a
              gather serves that one compute of the block — its parameters live until the
              compute ends — and a reduce-scatter that micro-batch's gradients
  Optimizer   the optimizer step over the parameters this device holds
Each carries its memory effect on its device: bytes allocated when it starts
(`alloc_bytes`) and freed when it ends (`free_bytes`), and `op`, the operation of the
iteration's schedule it was written from (lower/schedule.py: a task). One operation seen
from several devices — a transfer's send and receive, a collective's members — is one op, so
an instruction is named by its device and its op: `instruction_id(device, op)`. The simulator's
events of an unmerged schedule (the one a Program is written from) and the executor's measured
spans carry the same op, which is how prediction and measurement of one instruction are joined.

Validated on load (`validate`): every send has exactly one matching receive, collectives
agree on members, method and order, and no device waits on a peer that waits on it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from heterog.errors import ArtifactError, PlanError
from heterog.ir.kinds import CollectiveOp, InstructionKind, Phase, SyncMethod
from heterog.jsonio import Artifact

KIND = "heterog.Program"
SCHEMA_VERSION = (
    2  # 2: instruction op ids; sharded collectives (primitive, shards, phase, microbatch), shard fields of a block
)


@dataclass(frozen=True, kw_only=True, slots=True)
class InputPiece:
    """Samples [lo, hi) of `block`'s outputs for one compute: held here since that block's
    replica on this device computed them (tag None; its range starts at src_lo), or received
    by the transfer `tag`, whose gradients go back by the transfer `grad_tag`."""

    block: int
    lo: int
    hi: int
    src_lo: int = 0
    tag: int | None = None
    grad_tag: int | None = None


def instruction_id(device: str, op: int) -> str:
    """The name of device's instruction of operation `op`: unique in a Program (validate
    checks), the same in its simulation and in the spans its run measured."""
    return f"{op}@{device}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute:
    op: int
    block: int
    phase: Phase
    microbatch: int
    lo: int
    hi: int
    inputs: tuple[InputPiece, ...] = ()
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    kind: InstructionKind = InstructionKind.COMPUTE
    piece: int = 0  # which sequential piece of the replica's share [lo, hi) is (ir/accumulation.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Samples [lo, hi) of a block's outputs (forward) or of their gradients (backward)
    between this device and `peer`; a send and its receive share the tag (and the op)."""

    op: int
    tag: int
    peer: str
    src_block: int  # the producer block (whose outputs, or their gradients, move)
    dst_block: int  # the consumer block
    phase: Phase  # forward: activations producer → consumer; backward: their gradients back
    microbatch: int
    lo: int
    hi: int
    nbytes: float
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Send(Transfer):
    kind: InstructionKind = InstructionKind.SEND


@dataclass(frozen=True, kw_only=True, slots=True)
class Recv(Transfer):
    kind: InstructionKind = InstructionKind.RECV


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    op: int
    block: int
    method: SyncMethod
    members: tuple[str, ...]  # ring order
    server: str | None  # the parameter server (method ps)
    nodes: tuple[tuple[str, ...], ...]  # members by cluster node (hierarchical)
    nbytes: float
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    tie: str | None = None  # a tied parameter's copies, else the block's gradient bucket
    primitive: CollectiveOp = CollectiveOp.ALL_REDUCE
    shards: tuple[float, ...] = ()  # a sharded block's: each member's piece, in member order
    phase: Phase | None = None  # stage 3: the compute of the block this serves
    microbatch: int | None = None
    kind: InstructionKind = InstructionKind.COLLECTIVE

    @property
    def ident(self) -> tuple[int, str, str, str, int]:
        """Which collective this is: every member's instruction has the same."""
        mb = -1 if self.microbatch is None else self.microbatch
        return (self.block, self.tie or "", str(self.primitive), str(self.phase or ""), mb)

    @property
    def serves(self) -> tuple[int, Phase, int] | None:
        """(block, phase, micro-batch) of the compute a stage-3 gather feeds, else None."""
        if self.primitive is not CollectiveOp.ALL_GATHER or self.phase is None or self.microbatch is None:
            return None
        return (self.block, self.phase, self.microbatch)

    def describe(self) -> str:
        if self.tie:
            return f"tied parameter {self.tie!r}"
        if self.primitive is CollectiveOp.ALL_REDUCE:
            return f"block {self.block}"
        at = f" for {self.phase} of micro-batch {self.microbatch}" if self.phase else ""
        return f"{self.primitive} of block {self.block}{at}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Optimizer:
    op: int
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    kind: InstructionKind = InstructionKind.OPTIMIZER


Instruction = Compute | Send | Recv | Collective | Optimizer
_BY_KIND = {
    InstructionKind.COMPUTE: Compute,
    InstructionKind.SEND: Send,
    InstructionKind.RECV: Recv,
    InstructionKind.COLLECTIVE: Collective,
    InstructionKind.OPTIMIZER: Optimizer,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockInfo:
    """A block: groups (plan indices) run back to back by the same replicas."""

    groups: tuple[int, ...]
    devices: tuple[str, ...]
    shares: tuple[float, ...]
    sync: SyncMethod
    ps_device: str | None
    recompute: bool
    label: str
    shard_stage: int = 0  # ZeRO stage of its groups (ir/kinds.py ShardStage)
    shards: tuple[float, ...] = ()  # each replica's fraction of the sharded state, in replica order


@dataclass(frozen=True, kw_only=True)
class Program(Artifact, kind=KIND, version=SCHEMA_VERSION):
    devices: tuple[str, ...]  # rank r ↔ devices[r]
    blocks: tuple[BlockInfo, ...]
    microbatch_sizes: tuple[int, ...]
    instructions: dict[str, tuple[Instruction, ...]]  # device → its instructions, in order
    initial_bytes: dict[str, float]  # memory in use when the iteration starts
    plan: dict[str, Any] = field(default_factory=dict)  # the Plan it was lowered from (to_dict)
    # tensor parallelism: the split regions (norm, column linears, row linear) by capture node
    # name — exactly those the cost model priced split (lower/tensor_parallel.py)
    tp_regions: tuple[tuple[str, tuple[str, ...], str], ...] = ()

    def rank_of(self) -> dict[str, int]:
        return {d: r for r, d in enumerate(self.devices)}

    def describe(self, ins: Instruction) -> str:
        """A short name of an instruction, as timelines label it."""
        if isinstance(ins, Compute):
            piece = f".{ins.piece}" if ins.piece else ""
            return (
                f"{self.blocks[ins.block].label} {'F' if ins.phase == Phase.FORWARD else 'B'} mb{ins.microbatch}{piece}"
            )
        if isinstance(ins, (Send, Recv)):
            return f"{ins.kind} {ins.peer} mb{ins.microbatch}"
        if isinstance(ins, Collective) and ins.tie:
            return f"tied {ins.tie} sync"
        if isinstance(ins, Collective):  # an all-reduce by its method, a sharded block's by its primitive
            what = f"{ins.method} sync" if ins.primitive is CollectiveOp.ALL_REDUCE else str(ins.primitive)
            return f"{self.blocks[ins.block].label} {what}" + (f" {ins.phase} mb{ins.microbatch}" if ins.phase else "")
        return "optimizer step"

    def locations(self) -> dict[str, tuple[str, int]]:
        """instruction id → (its device, its index in the device's list)."""
        return {instruction_id(d, ins.op): (d, i) for d, lst in self.instructions.items() for i, ins in enumerate(lst)}

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per device: instruction counts by kind, bytes sent and received, and the peak
        memory the program implies when its instructions run one after another."""
        out = {}
        for d in self.devices:
            counts: dict[str, int] = defaultdict(int)
            sent = recv = 0.0
            level = peak = self.initial_bytes.get(d, 0.0)
            for ins in self.instructions[d]:
                counts[str(ins.kind)] += 1
                if isinstance(ins, Send):
                    sent += ins.nbytes
                elif isinstance(ins, Recv):
                    recv += ins.nbytes
                level += ins.alloc_bytes
                peak = max(peak, level)
                level -= ins.free_bytes
            out[d] = {
                "instructions": dict(counts),
                "sent_bytes": sent,
                "received_bytes": recv,
                "peak_memory_bytes": peak,
            }
        return out

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def ins(i: Instruction) -> dict[str, Any]:
            d = asdict(i)
            d["kind"] = str(i.kind)
            return d

        return {
            "devices": list(self.devices),
            "blocks": [asdict(b) for b in self.blocks],
            "microbatch_sizes": list(self.microbatch_sizes),
            "initial_bytes": self.initial_bytes,
            "instructions": {d: [ins(i) for i in lst] for d, lst in self.instructions.items()},
            "plan": self.plan,
            **({"tp_regions": [[n, list(c), r] for n, c, r in self.tp_regions]} if self.tp_regions else {}),
        }

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "<program>") -> Program:
        try:
            blocks = tuple(
                BlockInfo(
                    **{
                        **b,
                        "groups": tuple(b["groups"]),
                        "devices": tuple(b["devices"]),
                        "shares": tuple(b["shares"]),
                        "shards": tuple(b.get("shards", ())),
                        "sync": SyncMethod(b["sync"]),
                    }
                )
                for b in doc["blocks"]
            )
            instructions = {d: tuple(_instruction(x) for x in lst) for d, lst in doc["instructions"].items()}
            prog = Program(
                devices=tuple(doc["devices"]),
                blocks=blocks,
                microbatch_sizes=tuple(doc["microbatch_sizes"]),
                instructions=instructions,
                initial_bytes={k: float(v) for k, v in doc["initial_bytes"].items()},
                plan=doc.get("plan", {}),
                tp_regions=tuple((n, tuple(c), r) for n, c, r in doc.get("tp_regions", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"{source}: not a valid heterog Program ({type(e).__name__}: {e}); re-create it with `heterog lower`."
            ) from None
        validate(prog, source)
        return prog


def _instruction(x: dict[str, Any]) -> Instruction:
    kind = InstructionKind(x["kind"])
    body = {k: v for k, v in x.items() if k != "kind"}
    if kind is InstructionKind.COMPUTE:
        body["phase"] = Phase(body["phase"])
        body["inputs"] = tuple(InputPiece(**p) for p in body.get("inputs", ()))
    elif kind in (InstructionKind.SEND, InstructionKind.RECV):
        body["phase"] = Phase(body["phase"])
    elif kind is InstructionKind.COLLECTIVE:
        body["method"] = SyncMethod(body["method"])
        body["members"] = tuple(body["members"])
        body["nodes"] = tuple(tuple(n) for n in body["nodes"])
        body["primitive"] = CollectiveOp(body.get("primitive", CollectiveOp.ALL_REDUCE))
        body["shards"] = tuple(body.get("shards", ()))
        body["phase"] = Phase(body["phase"]) if body.get("phase") else None
    return _BY_KIND[kind](**body)


# -- validation -------------------------------------------------------------------------------
def validate(prog: Program, source: str = "<program>") -> None:
    """Raise PlanError naming the device and instruction at fault: unknown devices, a send
    without its receive (or the reverse), collectives whose members disagree, or a deadlock."""
    known = set(prog.devices)
    if set(prog.instructions) != known:
        raise PlanError(
            f"{source}: instruction lists for {sorted(set(prog.instructions) ^ known)} do "
            f"not match the program's devices; re-create it with `heterog lower`."
        )
    _check_ops(prog, source)
    _check_pairs(prog, source)
    _check_collectives(prog, source)
    from heterog.lower.deadlock import check_deadlock  # it reads this module's instruction types

    check_deadlock(prog, source)


def _check_ops(prog: Program, source: str) -> None:
    """Every instruction's id (device, op) names it alone."""
    for d, lst in prog.instructions.items():
        seen: dict[int, int] = {}
        for i, ins in enumerate(lst):
            if ins.op in seen:
                raise PlanError(
                    f"{source}: device {d!r} has two instructions of op {ins.op} (at {seen[ins.op]} and {i}); "
                    f"each instruction needs its own id. Re-create the program with `heterog lower`."
                )
            seen[ins.op] = i


def _check_pairs(prog: Program, source: str) -> None:
    sends: dict[int, tuple[str, Send | Recv]] = {}
    recvs: dict[int, tuple[str, Send | Recv]] = {}
    for d, lst in prog.instructions.items():
        for i in lst:
            if isinstance(i, (Send, Recv)):
                if i.peer not in prog.instructions:
                    raise PlanError(
                        f"{source}: device {d!r} has a {i.kind} (tag {i.tag}) with unknown peer {i.peer!r}."
                    )
                table = sends if isinstance(i, Send) else recvs
                if i.tag in table:
                    raise PlanError(
                        f"{source}: tag {i.tag} is used by two {i.kind}s ({table[i.tag][0]!r} "
                        f"and {d!r}); each transfer needs its own tag."
                    )
                table[i.tag] = (d, i)
    for tag in sends.keys() ^ recvs.keys():
        d, i = sends.get(tag) or recvs[tag]
        other = "receive" if tag in sends else "send"
        raise PlanError(
            f"{source}: device {d!r} has a {i.kind} (tag {tag}, {i.phase} of block "
            f"{i.src_block}→{i.dst_block}, micro-batch {i.microbatch}) with no matching "
            f"{other} on {i.peer!r}; it would wait forever."
        )
    for tag, (src, s) in sends.items():
        dst, r = recvs[tag]
        if (s.peer, r.peer) != (dst, src) or (s.lo, s.hi, s.microbatch, s.phase) != (r.lo, r.hi, r.microbatch, r.phase):
            raise PlanError(
                f"{source}: send tag {tag} on {src!r} and its receive on {dst!r} disagree "
                f"(peers {s.peer!r}/{r.peer!r}, samples [{s.lo}, {s.hi}) vs [{r.lo}, {r.hi}), "
                f"micro-batch {s.microbatch}/{r.microbatch})."
            )


def _check_collectives(prog: Program, source: str) -> None:
    seen: dict[tuple[int, str, str, str, int], Collective] = {}  # by Collective.ident
    order: dict[str, list[tuple[int, str, str, str, int]]] = {}
    for d, lst in prog.instructions.items():
        for i in lst:
            if not isinstance(i, Collective):
                continue
            everyone = set(i.members) | ({i.server} if i.server else set())
            if d not in everyone:
                raise PlanError(
                    f"{source}: device {d!r} runs the collective of {i.describe()} but is "
                    f"not one of its members {list(i.members)}."
                )
            first = seen.setdefault(i.ident, i)
            if (first.members, first.method, first.server, first.shards) != (i.members, i.method, i.server, i.shards):
                raise PlanError(
                    f"{source}: members of the collective of {i.describe()} disagree: {d!r} "
                    f"has {i.method} over {list(i.members)} (pieces {list(i.shards)}), another member "
                    f"{first.method} over {list(first.members)} (pieces {list(first.shards)})."
                )
            if i.shards and (len(i.shards) != len(i.members) or abs(sum(i.shards) - 1.0) > 1e-6):
                raise PlanError(
                    f"{source}: the collective of {i.describe()} gives {len(i.shards)} pieces summing "
                    f"to {sum(i.shards):.6g} for {len(i.members)} members; re-create it with `heterog lower`."
                )
            order.setdefault(d, []).append(i.ident)
    for ident, c in seen.items():
        everyone = set(c.members) | ({c.server} if c.server else set())
        for d in everyone:
            if ident not in order.get(d, []):
                raise PlanError(
                    f"{source}: device {d!r} is a member of the collective of {c.describe()} "
                    f"but never runs it; the other members would wait forever."
                )
