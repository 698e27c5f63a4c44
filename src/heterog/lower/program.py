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
              gradients and an all-gather of its parameters (`op`), member i owning the piece
              `shards[i]` of the flat buffer; with `phase` and `microbatch` set (stage 3) a
              gather serves that one compute of the block — its parameters live until the
              compute ends — and a reduce-scatter that micro-batch's gradients
  Optimizer   the optimizer step over the parameters this device holds
Each carries its memory effect on its device: bytes allocated when it starts
(`alloc_bytes`) and freed when it ends (`free_bytes`).

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
SCHEMA_VERSION = 2  # 2: sharded collectives (op, shards, phase, microbatch); shard fields of a block


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute:
    block: int
    phase: Phase
    microbatch: int
    lo: int
    hi: int
    inputs: tuple[InputPiece, ...] = ()
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    kind: InstructionKind = InstructionKind.COMPUTE


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Samples [lo, hi) of a block's outputs (forward) or of their gradients (backward)
    between this device and `peer`; a send and its receive share the tag."""

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
    block: int
    method: SyncMethod
    members: tuple[str, ...]  # ring order
    server: str | None  # the parameter server (method ps)
    nodes: tuple[tuple[str, ...], ...]  # members by cluster node (hierarchical)
    nbytes: float
    alloc_bytes: float = 0.0
    free_bytes: float = 0.0
    tie: str | None = None  # a tied parameter's copies, else the block's gradient bucket
    op: CollectiveOp = CollectiveOp.ALL_REDUCE
    shards: tuple[float, ...] = ()  # a sharded block's: each member's piece, in member order
    phase: Phase | None = None  # stage 3: the compute of the block this serves
    microbatch: int | None = None
    kind: InstructionKind = InstructionKind.COLLECTIVE

    @property
    def ident(self) -> tuple[int, str, str, str, int]:
        """Which collective this is: every member's instruction has the same."""
        mb = -1 if self.microbatch is None else self.microbatch
        return (self.block, self.tie or "", str(self.op), str(self.phase or ""), mb)

    @property
    def serves(self) -> tuple[int, Phase, int] | None:
        """(block, phase, micro-batch) of the compute a stage-3 gather feeds, else None."""
        if self.op is not CollectiveOp.ALL_GATHER or self.phase is None or self.microbatch is None:
            return None
        return (self.block, self.phase, self.microbatch)

    def describe(self) -> str:
        if self.tie:
            return f"tied parameter {self.tie!r}"
        if self.op is CollectiveOp.ALL_REDUCE:
            return f"block {self.block}"
        at = f" for {self.phase} of micro-batch {self.microbatch}" if self.phase else ""
        return f"{self.op} of block {self.block}{at}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Optimizer:
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
class Program(Artifact, kind=KIND, version=SCHEMA_VERSION, older=(1,)):
    devices: tuple[str, ...]  # rank r ↔ devices[r]
    blocks: tuple[BlockInfo, ...]
    microbatch_sizes: tuple[int, ...]
    instructions: dict[str, tuple[Instruction, ...]]  # device → its instructions, in order
    initial_bytes: dict[str, float]  # memory in use when the iteration starts
    plan: dict[str, Any] = field(default_factory=dict)  # the Plan it was lowered from (to_dict)

    def rank_of(self) -> dict[str, int]:
        return {d: r for r, d in enumerate(self.devices)}

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
        body["op"] = CollectiveOp(body.get("op", CollectiveOp.ALL_REDUCE))
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
    _check_pairs(prog, source)
    _check_collectives(prog, source)
    _check_deadlock(prog, source)


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


class _Lanes:
    """Each device's lane (execute/sync.py): the collectives it launched, run one after another
    in launch order; one completes once it heads the lane of every member."""

    def __init__(self, devices: tuple[str, ...], everyone: dict[tuple, set[str]]):
        self.everyone = everyone
        self.launched: dict[str, list[tuple]] = defaultdict(list)
        self.head = dict.fromkeys(devices, 0)  # the first collective not yet completed
        self.done: set[tuple] = set()

    def drained(self, d: str) -> bool:
        return self.head[d] == len(self.launched[d])

    def _heads(self, c: tuple, e: str) -> bool:
        return self.head[e] < len(self.launched[e]) and self.launched[e][self.head[e]] == c

    def run(self) -> bool:
        """Complete what can complete; whether anything did."""
        moved = False
        for d in self.head:
            while not self.drained(d):
                c = self.launched[d][self.head[d]]
                if not all(self._heads(c, e) for e in self.everyone[c]):
                    break
                self.done.add(c)
                for e in self.everyone[c]:
                    self.head[e] += 1
                moved = True
        return moved


def _check_deadlock(prog: Program, source: str) -> None:
    """Run the program abstractly, as the executor does: sends never block, a receive waits
    for its send, and a collective is launched without waiting onto its device's lane
    (`_Lanes`). A compute waits for the gather that serves it (a stage-3 sharded block's
    parameters); the optimizer step, like the end of the step, waits until every collective
    its device launched has completed. Every device must reach its end."""
    pos = {d: 0 for d in prog.devices}
    posted: set[int] = set()
    lanes = _Lanes(
        prog.devices,
        {
            i.ident: set(i.members) | ({i.server} if i.server else set())
            for lst in prog.instructions.values()
            for i in lst
            if isinstance(i, Collective)
        },
    )
    gather_for = {
        (d, i.serves): i.ident
        for d, lst in prog.instructions.items()
        for i in lst
        if isinstance(i, Collective) and i.serves is not None
    }
    lists = prog.instructions

    def blocked(d: str, i: Instruction) -> bool:
        if isinstance(i, Recv):
            return i.tag not in posted
        if isinstance(i, Optimizer):
            return not lanes.drained(d)
        if isinstance(i, Compute):
            wanted = gather_for.get((d, (i.block, i.phase, i.microbatch)))
            return wanted is not None and wanted not in lanes.done
        return False

    progress = True
    while progress:
        progress = lanes.run()
        for d in prog.devices:
            lst = lists[d]
            while pos[d] < len(lst) and not blocked(d, lst[pos[d]]):
                i = lst[pos[d]]
                if isinstance(i, Collective):
                    lanes.launched[d].append(i.ident)
                    lanes.run()
                elif isinstance(i, Send):
                    posted.add(i.tag)
                pos[d] += 1
                progress = True
    stuck = {
        d: lists[d][p] if p < len(lists[d]) else None
        for d, p in pos.items()
        if p < len(lists[d]) or not lanes.drained(d)
    }
    if stuck:
        what = "; ".join(
            f"{d!r} waits at instruction {pos[d]} ({_describe(i)})"
            if i is not None
            else f"{d!r} waits at its end for its collectives"
            for d, i in list(stuck.items())[:4]
        )
        raise PlanError(
            f"{source}: the program deadlocks: {what}. Each waits on a peer that waits "
            f"on it; re-create the program with `heterog lower` (its order cannot deadlock)."
        )


def _describe(i: Instruction) -> str:
    if isinstance(i, Recv):
        return f"receive tag {i.tag} from {i.peer!r}"
    if isinstance(i, Collective):
        return f"{i.method} collective of {i.describe()} with {list(i.members)}"
    if isinstance(i, Optimizer):
        return "optimizer step, waiting for the collectives this device launched"
    if isinstance(i, Compute):
        return f"{i.phase} of block {i.block}, micro-batch {i.microbatch}, waiting for its parameters"
    return str(i.kind)
