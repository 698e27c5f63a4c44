"""Each gradient-sync method of a Plan as its own code path, on any torch.distributed backend.

Every method is written with point-to-point messages (isend/irecv) inside a sub-group of its
members, so what runs is the algorithm the simulator times, not the backend's choice:

- `ring`: reduce-scatter then all-gather around the ring in the given member order
  (Patarasuk & Yuan 2009): 2(n−1) steps, each moving 1/n of the bucket to the next member;
- `tree`: reduce up a binary tree rooted at the first member, then broadcast down it;
- `hierarchical`: reduce inside each node to its leader (the node's first member), ring
  all-reduce among the leaders, broadcast inside each node;
- `ps`: HeteroG's parameter server — replicas send gradients to the server, which sums
  them, applies the optimizer to the copy it holds (it alone keeps the optimizer state) and
  sends the parameters back (`ParameterServer`).

Every all-reduce leaves all members with the same bits (each sum is computed once, by one
member, then copied), so replicas cannot drift apart through rounding. The sums are over
members in a fixed order, so a run is reproducible.

Messages of one call use tags `call_index * TAGS_PER_CALL + k`, where the call index counts
the calls on that sub-group; members issue their calls on a sub-group in the same order (the
Program's order), so their tags agree, and the sub-group keeps them apart from the
activation transfers of the default group. `ProcessGroupCache` owns the sub-groups: creating
one is collective over the default group, so every rank must ask for the same member sets in
the same order (`ProcessGroupCache.create_all`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from heterog.execute.p2p import wait_for
from heterog.ir.kinds import SyncMethod

TAGS_PER_CALL = 1 << 12


@dataclass(kw_only=True)
class ScratchBuffers:
    """Receive buffers reused from call to call (one per dtype and device, grown as needed).
    A fresh buffer's pages are faulted in as it is written: a fresh 12.6 MB copy took 12.6 ms
    on this CPU, into a reused buffer 2.4 ms; a ring step of a tied embedding's gradient
    receives 8.4 MB every iteration. Calls of one rank run one after another (one sync
    thread), so one buffer serves them all."""
    held: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer of t's shape, dtype and device, whose contents are undefined."""
        key = (t.dtype, t.device)
        buf = self.held.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self.held[key] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        return buf[:t.numel()].view(t.shape)


@dataclass(kw_only=True)
class ProcessGroupCache:
    """Sub-groups by their sorted member ranks, how many calls each has carried, and the
    receive buffers the calls reuse."""
    timeout_s: float
    groups: dict[tuple[int, ...], object] = field(default_factory=dict)
    calls: dict[tuple[int, ...], int] = field(default_factory=dict)
    scratch: ScratchBuffers = field(default_factory=ScratchBuffers)

    def create_all(self, member_sets: Sequence[Sequence[int]]) -> None:
        """Create every sub-group up front, in the given order, on every rank (new_group is
        collective over the default group, members or not)."""
        for members in member_sets:
            key = tuple(sorted(members))
            if key not in self.groups:
                self.groups[key] = dist.new_group(ranks=list(key), timeout=timedelta(seconds=self.timeout_s))

    def get(self, members: Sequence[int]) -> tuple[object, int]:
        """The sub-group of `members` and the tag base of the next call on it."""
        key = tuple(sorted(members))
        if key not in self.groups:
            raise AssertionError(f"sub-group {list(key)} was not created up front (create_all)")
        index = self.calls.get(key, 0)
        self.calls[key] = index + 1
        return self.groups[key], (index % (1 << 16)) * TAGS_PER_CALL


@dataclass(kw_only=True)
class _Link:
    """The point-to-point messages of one call, with the call's tag base and timeout."""
    rank: int
    pg: object
    tag: int
    timeout: timedelta
    scratch: ScratchBuffers = field(default_factory=ScratchBuffers)

    def exchange(self, send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None,
                 src: int | None, step: int) -> None:
        works = []
        send = send if send is not None and send.numel() else None   # a ring chunk may be empty
        recv = recv if recv is not None and recv.numel() else None   # (the same one on both ends)
        if send is not None:
            works.append((dist.isend(send.contiguous(), dst, group=self.pg, tag=self.tag + step), dst))
        if recv is not None:
            works.append((dist.irecv(recv, src, group=self.pg, tag=self.tag + step), src))
        for work, peer in works:
            wait_for(work, rank=self.rank, peer=peer, timeout=self.timeout, what=f"collective step {step}")


def allreduce_sum(flat: torch.Tensor, members: Sequence[int], method: SyncMethod | str,
                  nodes: Sequence[Sequence[int]] | None, groups: ProcessGroupCache) -> None:
    """Sum `flat` (1-D, contiguous) over `members` in place with the plan's method.

    `members` are global ranks in the method's order (the ring order; the tree's first
    member is its root). `nodes` partitions the members by machine, for hierarchical."""
    members = list(members)
    rank = dist.get_rank()
    assert rank in members, f"rank {rank} is not a member of {members}"
    assert flat.dim() == 1 and flat.is_contiguous(), "allreduce_sum takes a flat contiguous tensor"
    if len(members) == 1:
        return
    pg, tag = groups.get(members)
    link = _Link(rank=rank, pg=pg, tag=tag, timeout=timedelta(seconds=groups.timeout_s),
                 scratch=groups.scratch)
    method = SyncMethod(method)
    if method is SyncMethod.RING:
        ring_allreduce(flat, members, link)
    elif method is SyncMethod.TREE:
        tree_allreduce(flat, members, link)
    elif method is SyncMethod.HIERARCHICAL:
        hierarchical_allreduce(flat, members, nodes or [members], link)
    else:
        raise ValueError(f"allreduce_sum cannot run sync method {method!r}; the parameter server "
                         f"is ParameterServer.step.")


def ring_allreduce(flat: torch.Tensor, order: Sequence[int], link: _Link, step0: int = 0) -> int:
    """Reduce-scatter then all-gather around `order`; returns the next free step number."""
    n = len(order)
    i = order.index(link.rank)
    nxt, prv = order[(i + 1) % n], order[(i - 1) % n]
    chunks = torch.tensor_split(flat, n)
    step = step0
    for k in range(n - 1):   # reduce-scatter: after it, member i owns the sum of chunk i+1
        send, recv = chunks[(i - k) % n], chunks[(i - k - 1) % n]
        buf = link.scratch.like(recv)
        link.exchange(send, nxt, buf, prv, step)
        recv.add_(buf)
        step += 1
    for k in range(n - 1):   # all-gather: pass the finished chunks on
        send, recv = chunks[(i + 1 - k) % n], chunks[(i - k) % n]
        link.exchange(send, nxt, recv, prv, step)
        step += 1
    return step


def tree_allreduce(flat: torch.Tensor, order: Sequence[int], link: _Link, step0: int = 0) -> int:
    """Binary-tree reduce to order[0], then broadcast from it down the same tree."""
    n = len(order)
    i = order.index(link.rank)
    children = [c for c in (2 * i + 1, 2 * i + 2) if c < n]
    parent = (i - 1) // 2 if i > 0 else None
    buf = link.scratch.like(flat)
    for c in children:       # one tag per tree edge: step0 + child position
        link.exchange(None, None, buf, order[c], step0 + c)
        flat.add_(buf)
    if parent is not None:
        link.exchange(flat, order[parent], None, None, step0 + i)
        link.exchange(None, None, flat, order[parent], step0 + n + i)
    for c in children:
        link.exchange(flat, order[c], None, None, step0 + n + c)
    return step0 + 2 * n


def hierarchical_allreduce(flat: torch.Tensor, members: Sequence[int], nodes: Sequence[Sequence[int]],
                           link: _Link) -> None:
    """Reduce to each node's leader, ring all-reduce among leaders, broadcast in each node."""
    member_set = set(members)
    local = [[r for r in node if r in member_set] for node in nodes]
    local = [node for node in local if node]
    covered = sorted(r for node in local for r in node)
    if covered != sorted(members) or len(covered) != len(set(covered)):
        raise ValueError(f"hierarchical sync: nodes {list(map(list, nodes))} must partition the "
                         f"members {list(members)} (each member in exactly one node).")
    mine = next(node for node in local if link.rank in node)
    leader = mine[0]
    leaders = [node[0] for node in local]
    n = len(members)
    if link.rank == leader:
        buf = link.scratch.like(flat)
        for r in mine[1:]:
            link.exchange(None, None, buf, r, members.index(r))
            flat.add_(buf)
        if len(leaders) > 1:
            ring_allreduce(flat, leaders, link, step0=2 * n)
        for r in mine[1:]:
            link.exchange(flat, r, None, None, n + members.index(r))
    else:
        link.exchange(flat, leader, None, None, members.index(link.rank))
        link.exchange(None, None, flat, leader, n + members.index(link.rank))


class ParameterServer:
    """One bucket of parameters served by `server` for `replicas` (HeteroG's PS).

    `step(flat_grad)` on every member: replicas send their gradient, the server adds them in
    replica order (its own too when it is a replica), applies its optimizer to its copy of
    the parameters and sends the new parameters back; returns them (on the server, its copy
    itself: the caller copies them into the model before the next step). The server's copy
    starts as the first replica's parameters, sent at the first step, so a server that holds
    no replica needs no model. Only the server has an optimizer. The gradient sum and the
    replica's receive buffer are kept from step to step, as a server keeps its buffers: made
    anew, each was a fresh bucket-sized allocation every step (page faults on this CPU; the
    classifier's PS sync in cnn-small-memory took 0.5 s at the first steps, 0.05 s later)."""

    def __init__(self, *, server: int, replicas: Sequence[int], groups: ProcessGroupCache,
                 make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.server, self.replicas = server, list(replicas)
        self.members = sorted(set(self.replicas) | {server})
        self.groups = groups
        self.make_optimizer = make_optimizer
        self.master: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.buffer: torch.Tensor | None = None     # the server's gradient sum, a replica's parameters in

    def _kept(self, like: torch.Tensor) -> torch.Tensor:
        if self.buffer is None or self.buffer.shape != like.shape or self.buffer.dtype != like.dtype:
            self.buffer = torch.empty_like(like)
        return self.buffer

    @property
    def needs_parameters(self) -> bool:
        """Whether step() reads this member's parameters (at the first step only)."""
        return self.steps == 0

    def step(self, flat_grad: torch.Tensor, flat_params: torch.Tensor | None = None) -> torch.Tensor:
        """`flat_params`: this replica's current parameters (read at the first step only)."""
        rank = dist.get_rank()
        pg, tag = self.groups.get(self.members)
        link = _Link(rank=rank, pg=pg, tag=tag, timeout=timedelta(seconds=self.groups.timeout_s),
                     scratch=self.groups.scratch)
        first = self.steps == 0
        self.steps += 1
        n = len(self.members)
        if rank == self.server:
            return self._serve(flat_grad, flat_params, link, first, n)
        if first and rank == self.replicas[0] and self.server not in self.replicas:
            assert flat_params is not None, "the first replica sends the initial parameters"
            link.exchange(flat_params.detach(), self.server, None, None, 3 * n)
        link.exchange(flat_grad, self.server, None, None, self.members.index(rank))
        out = self._kept(flat_grad)
        link.exchange(None, None, out, self.server, n + self.members.index(rank))
        return out

    def _serve(self, flat_grad: torch.Tensor, flat_params: torch.Tensor | None, link: _Link,
               first: bool, n: int) -> torch.Tensor:
        if first:
            if self.server in self.replicas:
                assert flat_params is not None
                init = flat_params.detach().clone()
            else:
                init = torch.empty_like(flat_grad)
                link.exchange(None, None, init, self.replicas[0], 3 * n)
            self.master = torch.nn.Parameter(init)
            self.optimizer = self.make_optimizer([self.master])
        assert self.master is not None and self.optimizer is not None
        total = self._kept(self.master)
        if self.server in self.replicas:
            total.copy_(flat_grad.detach())
        else:
            total.zero_()
        buf = link.scratch.like(total)
        for r in self.replicas:
            if r != self.server:
                link.exchange(None, None, buf, r, self.members.index(r))
                total.add_(buf)
        self.master.grad = total
        self.optimizer.step()
        self.master.grad = None
        for r in self.replicas:
            if r != self.server:
                link.exchange(self.master.detach(), r, None, None, n + self.members.index(r))
        return self.master.detach()
