"""Each gradient-sync method of a Plan as its own code path, on any torch.distributed backend.

Every method is written with point-to-point messages (isend/irecv) inside a sub-group of its
members, so what runs is the algorithm the simulator times, not the backend's choice:

- `ring`: reduce-scatter then all-gather around the ring in the given member order
  (Patarasuk & Yuan 2009): 2(n−1) steps, each moving 1/n of the bucket to the next member.
  The halves run alone, with uneven pieces, for sharded state (`ring_reduce_scatter`,
  `ring_all_gather`; member i owns piece i, ir/plan.py `shard_piece`): torch's own
  reduce_scatter_tensor and all_gather_into_tensor take equal pieces only;
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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from heterog.execute.transport import wait_for
from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import shard_piece

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
        return buf[: t.numel()].view(t.shape)


@dataclass(kw_only=True)
class ProcessGroupCache:
    """Sub-groups by their sorted member ranks, how many calls each has carried, and the
    receive buffers the calls reuse."""

    timeout_s: float
    host_staging: bool = False  # CUDA tensors cross through host copies (gloo)
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

    def link(self, members: Sequence[int]) -> _Link:
        """The messages of the next call on the sub-group of `members` (this rank's side)."""
        pg, tag = self.get(members)
        return _Link(
            rank=dist.get_rank(),
            pg=pg,
            tag=tag,
            timeout=timedelta(seconds=self.timeout_s),
            scratch=self.scratch,
            host_staging=self.host_staging,
        )


@dataclass(kw_only=True)
class _Link:
    """The point-to-point messages of one call, with the call's tag base and timeout. Each
    step's send and receive are posted as one group (`dist.batch_isend_irecv`), so a
    two-member ring's send to and receive from the same peer progress together on NCCL.
    `host_staging`: CUDA tensors cross through host copies (gloo between ranks that share
    a GPU, transport.py)."""

    rank: int
    pg: Any  # the call's torch.distributed process group
    tag: int
    timeout: timedelta
    scratch: ScratchBuffers = field(default_factory=ScratchBuffers)
    host_staging: bool = False

    def exchange(
        self, send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None, step: int
    ) -> None:
        send = send if send is not None and send.numel() else None  # a ring chunk may be empty
        recv = recv if recv is not None and recv.numel() else None  # (the same one on both ends)
        staged = recv
        ops, peers = [], []
        if send is not None:
            assert dst is not None, "a send needs its peer"
            out = send.contiguous()
            if self.host_staging and out.device.type != "cpu":
                out = out.to("cpu")
            ops.append(dist.P2POp(dist.isend, out, dst, group=self.pg, tag=self.tag + step))
            peers.append(dst)
        if recv is not None:
            assert src is not None, "a receive needs its peer"
            staged = recv
            if self.host_staging and recv.device.type != "cpu":
                staged = torch.empty(recv.shape, dtype=recv.dtype, device="cpu")
            ops.append(dist.P2POp(dist.irecv, staged, src, group=self.pg, tag=self.tag + step))
            peers.append(src)
        if not ops:
            return
        for work, peer in zip(dist.batch_isend_irecv(ops), peers):
            wait_for(work, rank=self.rank, peer=peer, timeout=self.timeout, what=f"collective step {step}")
        if recv is not None and staged is not None and staged is not recv:
            recv.copy_(staged)


def allreduce_sum(
    flat: torch.Tensor,
    members: Sequence[int],
    method: SyncMethod | str,
    nodes: Sequence[Sequence[int]] | None,
    groups: ProcessGroupCache,
) -> None:
    """Sum `flat` (1-D, contiguous) over `members` in place with the plan's method.

    `members` are global ranks in the method's order (the ring order; the tree's first
    member is its root). `nodes` partitions the members by machine, for hierarchical."""
    members = list(members)
    rank = dist.get_rank()
    assert rank in members, f"rank {rank} is not a member of {members}"
    assert flat.dim() == 1 and flat.is_contiguous(), "allreduce_sum takes a flat contiguous tensor"
    if len(members) == 1:
        return
    link = groups.link(members)
    method = SyncMethod(method)
    if method is SyncMethod.RING:
        ring_allreduce(flat, members, link)
    elif method is SyncMethod.TREE:
        tree_allreduce(flat, members, link)
    elif method is SyncMethod.HIERARCHICAL:
        hierarchical_allreduce(flat, members, nodes or [members], link)
    else:
        raise ValueError(
            f"allreduce_sum cannot run sync method {method!r}; the parameter server is ParameterServer.step."
        )


def ring_allreduce(flat: torch.Tensor, order: Sequence[int], link: _Link, step0: int = 0) -> int:
    """Reduce-scatter then all-gather around `order` (equal pieces); returns the next free
    step number."""
    sizes = [len(c) for c in torch.tensor_split(flat, len(order))]
    step = ring_reduce_scatter(flat, sizes, order, link, step0)
    return ring_all_gather(flat, sizes, order, link, step)


def ring_reduce_scatter(
    flat: torch.Tensor, sizes: Sequence[int], order: Sequence[int], link: _Link, step0: int = 0
) -> int:
    """Sum `flat` over `order` piece by piece: afterwards the member at position i holds the
    total of piece i (`sizes[i]` elements, in order; pieces may differ and be empty) in
    place, the rest of its buffer holds partial sums. Returns the next free step number."""
    return _ring_half(flat, sizes, order, link, step0, "reduce_scatter")


def ring_all_gather(flat: torch.Tensor, sizes: Sequence[int], order: Sequence[int], link: _Link, step0: int = 0) -> int:
    """Every member's piece i (`sizes[i]` elements) of `flat`, held by the member at position
    i, to every member, in place. Returns the next free step number."""
    return _ring_half(flat, sizes, order, link, step0, "all_gather")


def _ring_half(flat: torch.Tensor, sizes: Sequence[int], order: Sequence[int], link: _Link, step0: int, op: str) -> int:
    """n − 1 steps around the ring: at step k the member at position i sends piece
    shard_piece(op, i, k) to its successor and receives its predecessor's, which it adds in
    (reduce-scatter) or keeps (all-gather)."""
    n = len(order)
    if n == 1:
        return step0
    i = order.index(link.rank)
    nxt, prv = order[(i + 1) % n], order[(i - 1) % n]
    pieces = torch.split(flat, list(sizes))
    for k in range(n - 1):
        send, recv = pieces[shard_piece(op, i, k, n)], pieces[shard_piece(op, i - 1, k, n)]
        if op == "reduce_scatter":
            buf = link.scratch.like(recv)
            link.exchange(send, nxt, buf, prv, step0 + k)
            recv.add_(buf)
        else:
            link.exchange(send, nxt, recv, prv, step0 + k)
    return step0 + n - 1


def tree_allreduce(flat: torch.Tensor, order: Sequence[int], link: _Link, step0: int = 0) -> int:
    """Binary-tree reduce to order[0], then broadcast from it down the same tree."""
    n = len(order)
    i = order.index(link.rank)
    children = [c for c in (2 * i + 1, 2 * i + 2) if c < n]
    parent = (i - 1) // 2 if i > 0 else None
    buf = link.scratch.like(flat)
    for c in children:  # one tag per tree edge: step0 + child position
        link.exchange(None, None, buf, order[c], step0 + c)
        flat.add_(buf)
    if parent is not None:
        link.exchange(flat, order[parent], None, None, step0 + i)
        link.exchange(None, None, flat, order[parent], step0 + n + i)
    for c in children:
        link.exchange(flat, order[c], None, None, step0 + n + c)
    return step0 + 2 * n


def hierarchical_allreduce(
    flat: torch.Tensor, members: Sequence[int], nodes: Sequence[Sequence[int]], link: _Link
) -> None:
    """Reduce to each node's leader, ring all-reduce among leaders, broadcast in each node."""
    member_set = set(members)
    local = [[r for r in node if r in member_set] for node in nodes]
    local = [node for node in local if node]
    covered = sorted(r for node in local for r in node)
    if covered != sorted(members) or len(covered) != len(set(covered)):
        raise ValueError(
            f"hierarchical sync: nodes {list(map(list, nodes))} must partition the "
            f"members {list(members)} (each member in exactly one node)."
        )
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

    A step is two phases on every member, in the same order on all of them:
    `push(flat_grad)`: replicas send their gradient, the server adds them in replica order
    (its own too when it is a replica); `pull()`: the server applies its optimizer to its
    copy of the parameters and sends the new parameters back; returns them (on the server,
    its copy itself: the caller copies them into the model before the next step). `step` is
    both at once. With fp16 the phases are apart: between them every rank learns whether any
    gradient overflowed (the server checks and unscales its sum, `unscale_and_check`), and a
    step that overflowed skips the pull on every member, as torch.amp.GradScaler skips it.

    The server's copy starts as the first replica's parameters, sent at the first step, so a
    server that holds no replica needs no model. Only the server has an optimizer; it is made
    with the server (`numel`), so a resumed run can load its state (`load_state`) before the
    first step. The copy is one flat tensor (`master`, what the messages carry) seen as one
    parameter per served parameter (`params`, views of it shaped as `shapes`), and the
    optimizer is made over those: the user's optimizer sees the shapes a single process
    would (parameter groups by dimension, per-tensor norms), and its state is per parameter.
    With a global gradient norm (clipping.py) the phases are apart too, and the server's sum
    is clipped between them. The gradient sum and the replica's receive buffer are kept from
    step to step, as a server keeps its buffers: made anew, each was a fresh bucket-sized
    allocation every step (page faults on this CPU; the classifier's PS sync in cnn-small-memory took
    0.5 s at the first steps, 0.05 s later)."""

    def __init__(
        self,
        *,
        server: int,
        replicas: Sequence[int],
        groups: ProcessGroupCache,
        make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer | None],
        numel: int,
        device: torch.device | None = None,
        shapes: Sequence[torch.Size] | None = None,
    ):
        self.server, self.replicas = server, list(replicas)
        self.members = sorted(set(self.replicas) | {server})
        self.groups = groups
        self.master: torch.Tensor | None = None
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        if dist.get_rank() == server:
            shapes = list(shapes) if shapes is not None else [torch.Size([numel])]
            assert sum(math.prod(s) for s in shapes) == numel, "the served shapes must add up to numel"
            self.master = torch.zeros(numel, device=device)
            self.params = [torch.nn.Parameter(piece) for piece in _views(self.master, shapes)]
            self.optimizer = make_optimizer(self.params)
        self.steps = 0
        self.buffer: torch.Tensor | None = None  # the server's gradient sum, a replica's parameters in
        self._link: _Link | None = None  # the call of the step under way

    def _kept(self, like: torch.Tensor) -> torch.Tensor:
        if self.buffer is None or self.buffer.shape != like.shape or self.buffer.dtype != like.dtype:
            self.buffer = torch.empty_like(like)
        return self.buffer

    @property
    def needs_parameters(self) -> bool:
        """Whether push() reads this member's parameters (at the first step only)."""
        return self.steps == 0

    def step(self, flat_grad: torch.Tensor, flat_params: torch.Tensor | None = None) -> torch.Tensor:
        """Both phases: `flat_params`, this replica's current parameters, is read at the first step only."""
        self.push(flat_grad, flat_params)
        return self.pull()

    def push(self, flat_grad: torch.Tensor, flat_params: torch.Tensor | None = None) -> None:
        rank = dist.get_rank()
        link = self._link = self.groups.link(self.members)
        first = self.steps == 0
        self.steps += 1
        n = len(self.members)
        if rank == self.server:
            self._gather(flat_grad, flat_params, link, first, n)
            return
        if first and rank == self.replicas[0] and self.server not in self.replicas:
            assert flat_params is not None, "the first replica sends the initial parameters"
            link.exchange(flat_params.detach(), self.server, None, None, 3 * n)
        link.exchange(flat_grad, self.server, None, None, self.members.index(rank))
        self._kept(flat_grad)  # the parameters come back into it (pull)

    def _gather(
        self, flat_grad: torch.Tensor, flat_params: torch.Tensor | None, link: _Link, first: bool, n: int
    ) -> None:
        assert self.master is not None
        if first:
            with torch.no_grad():
                if self.server in self.replicas:
                    assert flat_params is not None
                    self.master.copy_(flat_params.detach())
                else:
                    link.exchange(None, None, self.master.data, self.replicas[0], 3 * n)
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

    def unscale_and_check(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """fp16, between the phases: on the server, divide the gradient sum by the loss scale
        and set found_inf when it holds an inf or NaN (torch.amp's own kernel)."""
        if dist.get_rank() == self.server and self.buffer is not None:
            torch._amp_foreach_non_finite_check_and_unscale_([self.buffer], found_inf, inv_scale)

    def pull(self) -> torch.Tensor:
        rank = dist.get_rank()
        link, n = self._link, len(self.members)
        assert link is not None, "pull() before push()"
        self._link = None
        if rank == self.server:
            assert self.master is not None and self.buffer is not None
            if self.optimizer is not None:
                for p, g in zip(self.params, _views(self.buffer, [p.shape for p in self.params])):
                    p.grad = g
                self.optimizer.step()
                for p in self.params:
                    p.grad = None
            for r in self.replicas:
                if r != self.server:
                    link.exchange(self.master.detach(), r, None, None, n + self.members.index(r))
            return self.master.detach()
        assert self.buffer is not None
        link.exchange(None, None, self.buffer, self.server, n + self.members.index(rank))
        return self.buffer

    # -- checkpoints: the server's optimizer state, by parameter name ------------------------------
    def state_by_name(self, names: Sequence[str], shapes: Sequence[torch.Size]) -> dict[str, dict[str, torch.Tensor]]:
        """The server's optimizer state per served parameter (the keys a rank-local optimizer
        writes: AdamW's exp_avg, exp_avg_sq, step), so a checkpoint does not depend on who
        served."""
        if self.optimizer is None:
            return {}
        return {
            name: {k: v.detach().clone() for k, v in self.optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
            for name, p in zip(names, self.params)
        }

    def load_state(self, per_name: dict[str, dict[str, torch.Tensor]], names: Sequence[str]) -> None:
        """Set the server's optimizer state from per-parameter pieces (state_by_name's form)."""
        if self.optimizer is None:
            return
        for name, p in zip(names, self.params):
            if per_name.get(name):
                self.optimizer.state[p] = {k: v.clone() for k, v in per_name[name].items()}


def _views(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Consecutive pieces of a flat tensor, shaped as `shapes` (views: writes go through)."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out
