"""Point-to-point transfers of a Program: correct on NCCL by construction, the same code on gloo.

What NCCL requires, and how each requirement is met here:
- *Messages match in posting order* (NCCL ignores tags): every rank knows the whole Program,
  so a receiver knows the order in which a peer sends to it (the peer's Send instructions to
  this rank, in its program order), and posts its receives from that peer in exactly that
  order. When the receiver's own program needs a later message first, it posts the earlier
  ones then (their buffers wait in `_posted`) — posting early never blocks, and by the
  Program's deadlock check no message it waits for depends on one posted after it.
- *One communicator is one ordered stream*: a send and a receive between the same two ranks
  in opposite directions on one communicator can wait on each other (each side's first
  operation waits for the other's second). So each direction of every rank pair that
  exchanges tensors has a process group of its own (`Channels`): on a direction, one side
  only sends and the other only receives, in the same order.
- *Grouped operations progress together*: the messages of one instruction (the values a
  block boundary carries) are posted as one `dist.batch_isend_irecv` batch.
- *No host synchronisation per transfer*: shapes and dtypes come from the wire table
  (wire.py), never from a header read on the host; a receive's wait is a stream wait on a GPU.

On gloo (CPU ranks) the same calls run; gloo additionally matches by tag, and tags stay
unique per step. Two ranks that share one GPU cannot both join an NCCL communicator
("Duplicate GPU detected"): with `host_staging` such ranks use gloo and copy each tensor to
the host before sending and to the GPU after receiving — slower, and said so by the launcher.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from heterog.errors import RankError
from heterog.execute.wire import WireSpec
from heterog.ir.kinds import Phase
from heterog.lower.program import Program, Recv, Send

MAX_VALUES = 64  # values one transfer may carry (tags: (program tag · MAX_VALUES + k) · 2)


def wait_for(work: Any, *, rank: int, peer: int, timeout: timedelta, what: str) -> None:
    """Wait for a point-to-point operation; a timeout or a dead peer becomes a RankError that
    names both ranks. (On a GPU this makes the current stream wait; the host goes on.)"""
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RankError(
            rank,
            f"{what} with rank {peer} did not complete within "
            f"{timeout.total_seconds():.0f} s ({str(e).splitlines()[0]}); "
            f"rank {peer} may have died or hung.",
        ) from None


def transfer_pairs(program: Program, rank_of: dict[str, int]) -> list[tuple[int, int]]:
    """The (sender, receiver) rank pairs the Program moves tensors between, sorted."""
    pairs = {
        (rank_of[d], rank_of[ins.peer])
        for d, instructions in program.instructions.items()
        for ins in instructions
        if isinstance(ins, Send)
    }
    return sorted(pairs)


class Channels:
    """One process group per direction of every pair in `pairs`. Creating a group is
    collective over the default group, so every rank creates all of them, in the same order."""

    def __init__(self, pairs: Sequence[tuple[int, int]], timeout_s: float):
        self.groups: dict[tuple[int, int], Any] = {}
        for pair in pairs:
            self.groups[pair] = dist.new_group(ranks=sorted(pair), timeout=timedelta(seconds=timeout_s))

    def group(self, src: int, dst: int) -> Any:
        return self.groups[(src, dst)]


@dataclass(kw_only=True)
class _Posted:
    works: list[Any]
    buffers: list[torch.Tensor]  # an empty message: an empty tensor, nothing moved
    started_s: float = field(default_factory=time.perf_counter)


class Transport:
    """This rank's side of the step's transfers (module docstring); counts bytes sent."""

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        program: Program,
        rank_of: dict[str, int],
        crossing: dict[tuple[int, int], list[str]],
        no_grad: frozenset[str],
        wire: dict[str, WireSpec],
        channels: Channels,
        timeout_s: float,
        host_staging: bool = False,
    ):
        self.rank, self.device = rank, device
        self.rank_of, self.crossing, self.no_grad, self.wire = rank_of, crossing, no_grad, wire
        self.channels = channels
        self.timeout = timedelta(seconds=timeout_s)
        self.host_staging = host_staging
        me = program.devices[rank]
        # per peer: the tags of the transfers it sends to this rank, in its program order
        self._incoming: dict[int, list[int]] = {}
        for d, instructions in program.instructions.items():
            tags = [ins.tag for ins in instructions if isinstance(ins, Send) and ins.peer == me]
            if tags:
                self._incoming[rank_of[d]] = tags
        # an evaluation step runs the forward transfers alone (runtime.StepMode.EVALUATE)
        self._forward_incoming: dict[int, list[int]] = {}
        for d, instructions in program.instructions.items():
            tags = [
                ins.tag
                for ins in instructions
                if isinstance(ins, Send) and ins.peer == me and ins.phase == Phase.FORWARD
            ]
            if tags:
                self._forward_incoming[rank_of[d]] = tags
        self._order = self._incoming
        self._cursor: dict[int, int] = {}
        self._recv_of: dict[int, Recv] = {
            ins.tag: ins for ins in program.instructions.get(me, ()) if isinstance(ins, Recv)
        }
        self._posted: dict[int, _Posted] = {}
        self._pending: dict[Any, list[tuple[Any, torch.Tensor, int]]] = {}  # sends by key
        self.sent_bytes = 0

    # -- what a transfer carries -------------------------------------------------------------
    def messages(self, ins: Send | Recv) -> list[tuple[int, str]]:
        """(index k, value) of the tensors an instruction moves: the values crossing from its
        producer block to its consumer block; backward skips integer values (no gradient)."""
        values = self.crossing.get((ins.src_block, ins.dst_block), ())
        return [(k, v) for k, v in enumerate(values) if not (ins.phase == Phase.BACKWARD and v in self.no_grad)]

    @staticmethod
    def tag(ins: Send | Recv, k: int) -> int:
        return (ins.tag * MAX_VALUES + k) * 2

    # -- sends --------------------------------------------------------------------------------
    def send(self, ins: Send, tensors: Sequence[torch.Tensor], key: Any = None) -> None:
        """Post the instruction's tensors (one per message, in `messages` order) as one batch."""
        peer = self.rank_of[ins.peer]
        group = self.channels.group(self.rank, peer)
        ops, kept = [], []
        for (k, v), t in zip(self.messages(ins), tensors, strict=True):
            spec = self.wire[v]
            want = spec.shape(ins.hi - ins.lo)
            if tuple(t.shape) != want or t.dtype != spec.dtype:
                raise RankError(
                    self.rank,
                    f"the transfer of {v!r} (tag {ins.tag}) to rank {peer} is a "
                    f"{t.dtype} tensor of shape {tuple(t.shape)}, but the wire table "
                    f"says {spec.dtype} {want}; the receiver would read it wrongly.",
                )
            if t.numel() == 0:
                continue
            t = t.detach().contiguous()
            if self.host_staging and t.device.type != "cpu":
                t = t.to("cpu")
            ops.append(dist.P2POp(dist.isend, t, peer, group=group, tag=self.tag(ins, k)))
            kept.append(t)
            self.sent_bytes += t.numel() * t.element_size()
        if ops:
            works = dist.batch_isend_irecv(ops)
            self._pending.setdefault(key, []).extend((w, t, peer) for w, t in zip(works, kept))

    def release(self, key: Any) -> None:
        """Wait for the sends made with `key`, which the caller knows have arrived, and let
        go of their buffers."""
        for work, _, dst in self._pending.pop(key, ()):
            wait_for(work, rank=self.rank, peer=dst, timeout=self.timeout, what="send")

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers of sends not yet waited for and of receives posted early (live memory)."""
        sends = [t for sends in self._pending.values() for _, t, _ in sends]
        return sends + [b for p in self._posted.values() for b in p.buffers]

    def wait_all(self) -> None:
        """Wait for every send of the step (the receivers have posted theirs by now)."""
        pending, self._pending = self._pending, {}
        for sends in pending.values():
            for work, _, dst in sends:
                wait_for(work, rank=self.rank, peer=dst, timeout=self.timeout, what="send")
        assert not self._posted, f"rank {self.rank}: receives posted but never read: {sorted(self._posted)}"

    # -- receives -----------------------------------------------------------------------------
    def _post(self, ins: Recv) -> None:
        peer = self.rank_of[ins.peer]
        group = self.channels.group(peer, self.rank)
        ops, buffers = [], []
        where = torch.device("cpu") if self.host_staging else self.device
        for k, v in self.messages(ins):
            spec = self.wire[v]
            shape = spec.shape(ins.hi - ins.lo)
            buf = torch.empty(shape, dtype=spec.dtype, device=where)
            if buf.numel() == 0:
                buffers.append(buf)
                continue
            ops.append(dist.P2POp(dist.irecv, buf, peer, group=group, tag=self.tag(ins, k)))
            buffers.append(buf)
        works = dist.batch_isend_irecv(ops) if ops else []
        self._posted[ins.tag] = _Posted(works=works, buffers=buffers)

    def recv(self, ins: Recv) -> list[torch.Tensor]:
        """The instruction's tensors (in `messages` order): posts this peer's receives up to
        this one in the peer's sending order, then waits for this one's."""
        peer = self.rank_of[ins.peer]
        order = self._order.get(peer, [])
        if ins.tag not in self._posted:
            at = self._cursor.get(peer, 0)
            try:
                stop = order.index(ins.tag, at)
            except ValueError:
                raise RankError(
                    self.rank,
                    f"receive (tag {ins.tag}) from rank {peer}: the peer's program "
                    f"sends no such transfer after the ones already received; the "
                    f"Program is inconsistent — re-lower the plan.",
                ) from None
            for tag in order[at : stop + 1]:
                self._post(self._recv_of[tag])
            self._cursor[peer] = stop + 1
        posted = self._posted.pop(ins.tag)
        for work in posted.works:
            wait_for(work, rank=self.rank, peer=peer, timeout=self.timeout, what=f"receive (tag {ins.tag})")
        if self.host_staging and self.device.type != "cpu":
            return [b.to(self.device) for b in posted.buffers]
        return list(posted.buffers)

    def new_step(self, *, forward_only: bool = False) -> None:
        """A step starts: receives are posted from each peer's first send again (only its
        forward sends in an evaluation step, which runs no backward)."""
        self._order = self._forward_incoming if forward_only else self._incoming
        self._cursor.clear()
