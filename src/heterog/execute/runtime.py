"""One rank's training step under a Plan: stages, transfers, loss, backward, sync, update.

Each group is a stage (a submodule from partition.py). Within a micro-batch a replica owns
a contiguous range of samples, in replica order (`Plan.replica_samples`, the simulator's
split). A stage's input is assembled from the producers' ranges that overlap its own:
local slices, or pieces received from other ranks (p2p.py). Inputs from other stages are
detached leaves, so each stage's backward is one explicit `torch.autograd.backward` on its
outputs, run in reverse global order; the leaves' gradients go back to their producers the
same way the activations came (as in torch.distributed.pipelining). Schedule: GPipe — every
micro-batch's forward, then every backward in reverse; or 1F1B (Executor.events).

Exactness: the loss of a replica's samples is mean-reduced by the zoo entry, so it is
scaled by samples / global_batch; summing over replicas and micro-batches then gives the
global-batch mean loss, and sync.py sums the gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint

from heterog.errors import PlanError
from heterog.execute.emulation import Pacer
from heterog.execute.p2p import P2P
from heterog.execute.partition import INPUT, Dataflow, Stage
from heterog.execute.workload import Workload, slice_batch
from heterog.ir.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Samples [lo, hi) of a micro-batch's value, from src's copy to dst's."""
    value: str
    src: int
    dst: int
    lo: int
    hi: int
    src_lo: int      # where src's copy starts
    src_hi: int      # where src's copy ends
    dst_lo: int      # where dst's input starts
    tag: int         # base tag (4 tags per piece)


@dataclass(kw_only=True)
class StepStats:
    compute_s: float = 0.0       # measured forward/backward/optimizer wall time (before pacing)
    cpu_s: float = 0.0           # CPU time of that compute (this thread)
    paced_s: float = 0.0         # waiting added to emulate a slower device
    samples: int = 0


def replica_ranges(plan: Plan, group: int, microbatch: int) -> list[tuple[int, int]]:
    """[lo, hi) of each replica of `group` within micro-batch `microbatch`."""
    out, lo = [], 0
    for n in plan.replica_samples(plan.groups[group], microbatch):
        out.append((lo, lo + n))
        lo += n
    return out


class StepProgram:
    """The per-step transfer table, identical on every rank (so tags agree)."""

    def __init__(self, plan: Plan, flow: Dataflow, rank_of: dict[str, int]):
        self.plan, self.flow = plan, flow
        self.M = plan.num_microbatches
        self.mb_offsets = [0]
        for m in range(self.M):
            self.mb_offsets.append(self.mb_offsets[-1] + plan.microbatch_size(m))
        self.ranks = {gi: [rank_of[r.device] for r in g.replicas] for gi, g in enumerate(plan.groups)}
        self.ranges = {(gi, m): replica_ranges(plan, gi, m) for gi in range(len(plan.groups))
                       for m in range(self.M)}
        self.inputs: dict[tuple[int, int, int, int], list[Piece]] = {}  # (stage, arg, m, rank)
        self.sends: dict[tuple[str, int, int], list[Piece]] = {}      # (stage value, m, src)
        tag = 0
        for m in range(self.M):
            for si, s in enumerate(flow.stages):
                for dst, (a, b) in zip(self.ranks[s.group], self.ranges[(s.group, m)]):
                    if a == b:
                        continue
                    for ai, v in enumerate(s.args):
                        h = flow.owner[v]
                        if h == INPUT:
                            continue
                        pieces = []
                        for src, (c, d) in zip(self.ranks[h], self.ranges[(h, m)]):
                            lo, hi = max(a, c), min(b, d)
                            if lo >= hi:
                                continue
                            p = Piece(value=v, src=src, dst=dst, lo=lo, hi=hi, src_lo=c, src_hi=d, dst_lo=a,
                                      tag=tag)
                            tag += 4
                            pieces.append(p)
                            if src != dst:
                                stage_value = flow.projections.get(v, (v, 0))[0]
                                self.sends.setdefault((stage_value, m, src), []).append(p)
                        self.inputs[(si, ai, m, dst)] = pieces

    def my_range(self, group: int, m: int, rank: int) -> tuple[int, int] | None:
        for r, rng in zip(self.ranks[group], self.ranges[(group, m)]):
            if r == rank:
                return rng
        return None


@dataclass(kw_only=True)
class _Call:
    stage: Stage
    m: int
    out: Any
    leaves: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)  # (arg index, leaf)
    loss: torch.Tensor | None = None


class Executor:
    """Runs training steps for one rank."""

    def __init__(self, *, plan: Plan, flow: Dataflow, work: Workload, rank: int,
                 rank_of: dict[str, int], p2p: P2P, pacer: Pacer, sync=None):
        self.plan, self.flow, self.work, self.rank = plan, flow, work, rank
        self.program = StepProgram(plan, flow, rank_of)
        self.p2p, self.pacer = p2p, pacer
        self.stats = StepStats()
        self.sync = sync  # sync.GradSync: launched during backward, finished by the caller
        if sync is not None:
            sync.schedule(self.events())
        self._env: dict[tuple[str, int], Any] = {}

    # -- helpers --------------------------------------------------------------------------
    def _timed(self, fn, *args, **kwargs):
        """Run compute; account its wall time and pace it (emulation.py: on CPU time)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self.stats.compute_s += wall
        self.stats.cpu_s += cpu
        self.stats.paced_s += self.pacer.pace(wall, cpu)
        return out

    def _piece_of(self, local: Any, p: Piece) -> torch.Tensor:
        """Samples [p.lo, p.hi) of a value held here for [p.src_lo, p.src_hi)."""
        if not isinstance(local, torch.Tensor) or local.dim() == 0 or local.shape[0] != p.src_hi - p.src_lo:
            what = (f"a {type(local).__name__}" if not isinstance(local, torch.Tensor)
                    else f"a tensor of shape {tuple(local.shape)}")
            raise PlanError(f"value {p.value!r} is {what}, not batch-first with {p.src_hi - p.src_lo} "
                            f"samples, yet it crosses groups with different sample ranges; only "
                            f"batch-first tensors can be re-partitioned. Merge its producer and "
                            f"consumer groups.")
        return local[p.lo - p.src_lo:p.hi - p.src_lo]

    def _value(self, env: dict, v: str, m: int) -> Any:
        if v in self.flow.projections:
            src, idx = self.flow.projections[v]
            return env[(src, m)][idx]
        return env[(v, m)]

    def _gather(self, env: dict, si: int, ai: int, v: str, m: int, a: int, b: int,
                mb_inputs: dict[str, Any]) -> tuple[Any, bool]:
        """Samples [a, b) of value v for stage si; returns (value, is a grad leaf)."""
        if self.flow.owner[v] == INPUT:
            return slice_batch(mb_inputs[v], a, b), False
        pieces = self.program.inputs[(si, ai, m, self.rank)]
        if (len(pieces) == 1 and pieces[0].src == self.rank
                and (pieces[0].src_lo, pieces[0].src_hi) == (a, b)):
            local = self._value(env, v, m)   # exactly this range is held here: use it as is
            if not isinstance(local, torch.Tensor):
                return local, False
            parts = [local]
        else:
            parts = []
            for p in pieces:
                if p.src == self.rank:
                    local = self._value(env, v, m)
                    parts.append(self._piece_of(local, p))
                else:
                    parts.append(self.p2p.recv_with_header(p.src, p.tag))
        x = parts[0] if len(parts) == 1 else torch.cat([t.detach() for t in parts])
        x = x.detach()
        if x.is_floating_point():
            x.requires_grad_(True)
            return x, True
        return x, False

    # -- one step ---------------------------------------------------------------------------
    def events(self) -> list[tuple[str, int, int]]:
        """The step's global order of ('F'|'B', micro-batch, stage), the same on every rank;
        each rank runs its own events in this order (p2p.py: why that cannot deadlock).

        gpipe: every forward, then every backward in reverse. 1f1b: forwards of the first
        W = min(stages, micro-batches) micro-batches, then backward of m followed by forward
        of m + W, so at most W micro-batches hold activations at once."""
        M, S = self.program.M, len(self.flow.stages)
        fwd = lambda m: [("F", m, si) for si in range(S)]  # noqa: E731
        bwd = lambda m: [("B", m, si) for si in reversed(range(S))]  # noqa: E731
        if self.plan.schedule != "1f1b":
            return [e for m in range(M) for e in fwd(m)] + [e for m in reversed(range(M)) for e in bwd(m)]
        W = min(S, M)
        out = [e for m in range(W) for e in fwd(m)]
        for m in range(M):
            out += bwd(m)
            if m + W < M:
                out += fwd(m + W)
        return out

    def step(self, inputs: tuple[Any, ...], targets: Any) -> float:
        """Forward and backward of every micro-batch; returns this rank's summed loss."""
        self._env = {}
        self._inputs = dict(zip(self.flow.inputs, inputs))
        self._targets = targets
        self._loss_total = 0.0
        calls: dict[tuple[int, int], _Call] = {}
        grads: dict[tuple[str, int], torch.Tensor] = {}
        for index, (kind, m, si) in enumerate(self.events()):
            if kind == "F":
                call = self._forward(m, si)
                if call is not None:
                    calls[(m, si)] = call
            elif (m, si) in calls:
                self._backward(calls.pop((m, si)), grads)
                if not any(k[0] == m for k in calls):  # micro-batch m done: free its values
                    for key in [k for k in self._env if k[1] == m]:
                        del self._env[key]
            if self.sync is not None:
                self.sync.launch_ready(index)
        assert not calls
        return self._loss_total

    def _forward(self, m: int, si: int) -> _Call | None:
        prog, flow, env = self.program, self.flow, self._env
        s = flow.stages[si]
        rng = prog.my_range(s.group, m, self.rank)
        if rng is None or rng[0] == rng[1]:
            return None
        a, b = rng
        lo, hi = prog.mb_offsets[m], prog.mb_offsets[m + 1]
        mb_inputs = {k: slice_batch(v, lo, hi) for k, v in self._inputs.items()}
        args, leaves = [], []
        for ai, v in enumerate(s.args):
            x, is_leaf = self._gather(env, si, ai, v, m, a, b, mb_inputs)
            args.append(x)
            leaves.append((ai, x if is_leaf else None))
        if any(self.plan.groups[g].recompute for g in s.groups):
            # activation recomputation: keep only the stage's inputs; re-run forward in backward
            out = self._timed(torch.utils.checkpoint.checkpoint, s.module, *args, use_reentrant=False)
        else:
            out = self._timed(s.module, *args)
        env[(s.value, m)] = out
        call = _Call(stage=s, m=m, out=out, leaves=leaves)
        for p in prog.sends.get((s.value, m, self.rank), []):
            self.p2p.send_with_header(self._piece_of(self._value(env, p.value, m), p), p.dst, p.tag)
        if flow.projections.get(flow.output, (flow.output,))[0] == s.value:
            y = self._value(env, flow.output, m)
            mb_targets = slice_batch(self._targets, lo, hi)
            loss = self._timed(self.work.loss, y, slice_batch(mb_targets, a, b))
            call.loss = loss * ((b - a) / self.plan.batch_size)
            self._loss_total += float(call.loss.detach())
        return call

    def _add_grad(self, grads: dict, key: tuple[str, int], like: torch.Tensor, lo: int, hi: int,
                  g: torch.Tensor) -> None:
        buf = grads.get(key)
        if buf is None:
            buf = grads[key] = torch.zeros_like(like)
        buf[lo:hi] += g

    def _backward(self, call: _Call, grads: dict) -> None:
        s, m, flow = call.stage, call.m, self.flow
        # Gradients of this stage's outputs: sent back by remote consumers, added to those
        # local consumers already accumulated (they ran backward earlier: reverse order).
        for p in self.program.sends.get((s.value, m, self.rank), []):
            like = self._value(self._env, p.value, m)
            g = self.p2p.recv(tuple(like[p.lo - p.src_lo:p.hi - p.src_lo].shape), like.dtype, p.dst, p.tag + 2)
            self._add_grad(grads, (p.value, m), like, p.lo - p.src_lo, p.hi - p.src_lo, g)
        roots, root_grads = [], []
        if call.loss is not None:
            roots.append(call.loss)
            root_grads.append(None)
        outs = call.out if isinstance(call.out, (tuple, list)) else None
        if outs is None:
            if (s.value, m) in grads and isinstance(call.out, torch.Tensor) and call.out.requires_grad:
                roots.append(call.out)
                root_grads.append(grads.pop((s.value, m)))
        else:
            for proj, (src, idx) in flow.projections.items():
                if src == s.value and (proj, m) in grads and outs[idx].requires_grad:
                    roots.append(outs[idx])
                    root_grads.append(grads.pop((proj, m)))
        if roots:
            self._timed(torch.autograd.backward, roots, root_grads)
        # Gradients of this stage's inputs go back to their producers.
        a = self.program.my_range(s.group, m, self.rank)[0]
        si = flow.stages.index(s)
        for ai, leaf in call.leaves:
            if leaf is None:
                continue
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for p in self.program.inputs[(si, ai, m, self.rank)]:
                part = g[p.lo - a:p.hi - a]
                if p.src == self.rank:
                    like = self._value(self._env, p.value, m)
                    self._add_grad(grads, (p.value, m), like, p.lo - p.src_lo, p.hi - p.src_lo, part)
                else:
                    self.p2p.isend(part, p.src, p.tag + 2)
