"""Gradient synchronisation of replicated groups, by the Plan's method.

Each replica's loss is already scaled by its share of the global batch (samples / B, see
runtime.py), so the *sum* of the replicas' gradients is the global-batch gradient; every
method below therefore sums:
- ring / tree / hierarchical: an all-reduce(SUM) on the sub-group of the group's replicas
  (gloo and NCCL pick their own algorithm; the plan's choice shapes the prediction only);
- ps: reduce(SUM) to the parameter-server rank, then broadcast from it — the server may be a
  device that holds no replica of the group, in which case it contributes zeros.
Overlap: a group's gradients are final once the last backward of every stage running it
is done, so its collective is launched right then (asynchronously) while backward goes on
(`launch_ready`, called after each event of the step), and `finish` waits for all of them.
The launch point is an index in the step's global event order, the same on every rank
(also on a rank that skips the event for lack of samples, or a server without a replica),
so members issue their collectives on each sub-group in the same order.

Groups with the same members, method and server are synchronised together: their gradients
are flattened into buckets of at most `plan.bucket_bytes`, so one collective moves many
small tensors (a planner's plan often has dozens of small groups with one placement).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from heterog.errors import RankError
from heterog.execute.partition import Dataflow
from heterog.ir.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class _GroupSync:
    groups: tuple[int, ...]
    method: str
    members: tuple[int, ...]      # global ranks: replicas, plus the server for ps
    server: int | None
    pg: object                    # the torch ProcessGroup of `members`


class GradSync:
    def __init__(self, plan: Plan, flow: Dataflow, rank_of: dict[str, int], rank: int,
                 numel_of_group: dict[int, int], timeout_s: float):
        self.rank = rank
        self.plan = plan
        self.flow = flow
        self.numel = numel_of_group
        self.timeout_s = timeout_s
        self.items: list[_GroupSync] = []
        self.sync_s = 0.0
        self.ready_at: list[int] = []   # per item: the event index after which it launches
        self._pending: list[tuple[_GroupSync, list, torch.Tensor, object]] = []
        pgs: dict[tuple[int, ...], object] = {}
        together: dict[tuple, list[int]] = {}
        # new_group is collective over the default group: every rank creates every sub-group,
        # in the same order, even those it is not a member of.
        for gi, g in enumerate(plan.groups):
            members = {rank_of[r.device] for r in g.replicas}
            server = rank_of[g.ps_device] if g.sync == "ps" and g.ps_device else None
            if server is not None:
                members.add(server)
            key = tuple(sorted(members))
            if len(key) < 2 or not self.numel.get(gi):
                continue
            if key not in pgs:
                pgs[key] = dist.new_group(ranks=list(key), timeout=timedelta(seconds=timeout_s))
            method = "ps" if g.sync == "ps" else "allreduce"
            together.setdefault((key, method, server), []).append(gi)
        for (key, method, server), groups in together.items():
            if rank in key:
                self.items.append(_GroupSync(groups=tuple(groups), method=method, members=key,
                                             server=server, pg=pgs[key]))

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        # The same split as _server_bucket_sizes, so the server's buffers match.
        out: list[list[torch.nn.Parameter]] = []
        sizes = self._server_bucket_sizes_of([p.numel() for p in params])
        it = iter(params)
        for n in sizes:
            bucket, total = [], 0
            while total < n:
                p = next(it)
                bucket.append(p)
                total += p.numel()
            out.append(bucket)
        return out

    def schedule(self, events: list[tuple[str, int, int]]) -> None:
        """Launch each item after the last backward event of the stages that run its groups."""
        last_b: dict[int, int] = {}
        for i, (kind, _, si) in enumerate(events):
            if kind == "B":
                last_b[si] = i
        self.ready_at = []
        for item in self.items:
            stages = [si for si, st in enumerate(self.flow.stages) if set(st.groups) & set(item.groups)]
            self.ready_at.append(max((last_b[si] for si in stages), default=len(events) - 1))

    def launch_ready(self, event_index: int) -> None:
        t0 = time.perf_counter()
        for item, at in zip(self.items, self.ready_at):
            if at == event_index:
                self._guard(item, self._launch, item)
        self.sync_s += time.perf_counter() - t0

    def _launch(self, item: _GroupSync) -> None:
        params = [p for g in item.groups for _, p in self.flow.params_of_group.get(g, [])]
        if any(p.numel() for p in params):
            for bucket in self._buckets(params):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in bucket])
                self._pending.append((item, bucket, flat, self._start(item, flat)))
        else:  # a parameter server without a replica: same bucket sizes, zeros in
            numels = [n for g in item.groups for n in self.flow.param_numels[g]]
            for bucket_numel in self._server_bucket_sizes_of(numels):
                flat = torch.zeros(bucket_numel)
                self._pending.append((item, [], flat, self._start(item, flat)))

    def _start(self, item: _GroupSync, flat: torch.Tensor):
        if item.method == "ps":
            assert item.server is not None
            return dist.reduce(flat, dst=item.server, op=dist.ReduceOp.SUM, group=item.pg, async_op=True)
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=item.pg, async_op=True)

    def finish(self) -> None:
        """Wait for every launched collective (in launch order) and install the gradients."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for item, bucket, flat, work in pending:
            self._guard(item, self._complete, item, bucket, flat, work)
        self.sync_s += time.perf_counter() - t0

    def _complete(self, item: _GroupSync, bucket: list, flat: torch.Tensor, work) -> None:
        work.wait(timedelta(seconds=self.timeout_s))
        if item.method == "ps":  # the server's sum back to every member
            dist.broadcast(flat, src=item.server, group=item.pg)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def _guard(self, item: _GroupSync, fn, *args) -> None:
        try:
            fn(*args)
        except RuntimeError as e:
            names = ", ".join(self.plan.groups[g].name for g in item.groups[:4])
            raise RankError(self.rank, f"gradient sync of group(s) {names} with ranks "
                                       f"{list(item.members)} failed or timed out after "
                                       f"{self.timeout_s:.0f} s ({str(e).splitlines()[0]}).") from None

    def _server_bucket_sizes_of(self, shapes: list[int]) -> list[int]:
        limit = max(1, self.plan.bucket_bytes // 4)
        out = [0]
        for n in shapes:
            if out[-1] and out[-1] + n > limit:
                out.append(0)
            out[-1] += n
        return out
