"""Gradient synchronisation of replicated groups, by the Plan's method.

Each replica's loss is already scaled by its share of the global batch (samples / B, see
runtime.py), so the *sum* of the replicas' gradients is the global-batch gradient; every
method below therefore sums:
- ring / tree / hierarchical: an all-reduce(SUM) on the sub-group of the group's replicas
  (gloo and NCCL pick their own algorithm; the plan's choice shapes the prediction only);
- ps: reduce(SUM) to the parameter-server rank, then broadcast from it — the server may be a
  device that holds no replica of the group, in which case it contributes zeros.
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

    def sync(self) -> None:
        t0 = time.perf_counter()
        for item in self.items:
            params = [p for g in item.groups for _, p in self.flow.params_of_group.get(g, [])]
            holds = any(p.numel() for p in params)
            try:
                if holds:
                    for bucket in self._buckets(params):
                        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                          for p in bucket])
                        self._reduce(item, flat)
                        offset = 0
                        for p in bucket:
                            n = p.numel()
                            p.grad = flat[offset:offset + n].view_as(p).clone()
                            offset += n
                else:  # a parameter server without a replica: same bucket sizes, zeros in
                    numels = [n for g in item.groups for n in self.flow.param_numels[g]]
                    for bucket_numel in self._server_bucket_sizes_of(numels):
                        self._reduce(item, torch.zeros(bucket_numel))
            except RuntimeError as e:
                names = ", ".join(self.plan.groups[g].name for g in item.groups[:4])
                raise RankError(self.rank, f"gradient sync of group(s) {names} "
                                           f"with ranks {list(item.members)} failed or timed out after "
                                           f"{self.timeout_s:.0f} s ({str(e).splitlines()[0]}).") from None
        self.sync_s += time.perf_counter() - t0

    def _server_bucket_sizes_of(self, shapes: list[int]) -> list[int]:
        limit = max(1, self.plan.bucket_bytes // 4)
        out = [0]
        for n in shapes:
            if out[-1] and out[-1] + n > limit:
                out.append(0)
            out[-1] += n
        return out

    def _reduce(self, item: _GroupSync, flat: torch.Tensor) -> None:
        if item.method == "ps":
            assert item.server is not None
            dist.reduce(flat, dst=item.server, op=dist.ReduceOp.SUM, group=item.pg)
            dist.broadcast(flat, src=item.server, group=item.pg)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=item.pg)
