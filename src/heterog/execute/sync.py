"""Gradient synchronisation of replicated groups and tied parameters, by the Plan's method.

Each replica's loss is already scaled by its share of the global batch (samples / B, see
runtime.py), so the *sum* of the replicas' gradients is the global-batch gradient. Each
method runs its own code path (collectives.py): ring, tree and hierarchical all-reduce sum
the gradients on every member; a parameter server sums them on the server, which applies
the optimizer to its copy (it alone holds that state) and sends the parameters back — a
replica then installs them and clears the gradient, so its local optimizer skips them.

Parameters forward never reads have no gradient anywhere and are not synchronised (an
optimizer skips them, as in single-process training). Tied parameters (partition.py: one parameter read by several groups, e.g. an embedding and
the output projection) are left out of their groups' sync: every rank holding a copy adds
its local gradient in one ring all-reduce over all holders, then each holder steps its copy
with the same gradient, so the copies stay equal (Megatron-LM's embedding all-reduce).

A sync unit is a `Bucket`: parameter names (the same list on every rank), members in the
method's order, method, server and nodes. Buckets run on one background thread, in the
order they are launched (the same on every rank), so they overlap the backward pass; each
uses its own sub-group, apart from the activation transfers.

`ProgramSync` drives it from a lowered Program: one bucket per Collective instruction (a
block's parameters, or with `tie` a tied parameter's copies), launched when the rank's
interpreter reaches the instruction.
"""

from __future__ import annotations

import dataclasses

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from heterog.errors import RankError
from heterog.execute.collectives import ParameterServer, ProcessGroupCache, allreduce_sum
from heterog.execute.partition import Dataflow
from heterog.execute.workload import make_optimizer
from heterog.ir.kinds import SyncMethod


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Parameters synchronised together by one collective."""
    label: str                                   # for errors: the groups or the tied parameter
    names: tuple[str, ...]
    numel: int
    members: tuple[int, ...]                     # ranks, in the method's order (ring order)
    method: SyncMethod
    server: int | None = None
    replicas: tuple[int, ...] = ()               # ps: the ranks that compute gradients
    nodes: tuple[tuple[int, ...], ...] | None = None


def tie_buckets(flow: Dataflow, ranks_of_group: dict[int, Sequence[int]]) -> list[Bucket]:
    """One ring all-reduce per tied parameter, over every rank that holds a copy."""
    out = []
    for name in sorted(flow.tied):
        members = sorted({r for g in flow.tied[name] for r in ranks_of_group[g]})
        if len(members) > 1:
            out.append(Bucket(label=f"tied {name}", names=(name,), numel=flow.param_numel[name],
                              members=tuple(members), method=SyncMethod.RING))
    return out


class BucketRunner:
    """Runs buckets on this rank: gathers gradients, syncs on a background thread, installs."""

    def __init__(self, *, flow: Dataflow, rank: int, optimizer: str, timeout_s: float,
                 device: torch.device | None = None):
        self.flow, self.rank, self.optimizer = flow, rank, optimizer
        self.device = device or torch.device("cpu")
        self.groups = ProcessGroupCache(timeout_s=timeout_s)
        self.servers: dict[tuple[str, ...], ParameterServer] = {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heterog-sync")
        self._pending: list[tuple[Bucket, Future, bool]] = []
        self.sync_s = 0.0

    def kept_buffers(self) -> list[torch.Tensor]:
        """The buffers kept from step to step: the collectives' receive buffers and each
        parameter server's (execute/collectives.py), for the emulated memory cap."""
        kept = list(self.groups.scratch.held.values())
        return kept + [s.buffer for s in self.servers.values() if s.buffer is not None]

    def create_groups(self, buckets: Sequence[Bucket]) -> None:
        self.groups.create_all([b.members for b in buckets])

    def _params(self, bucket: Bucket) -> list[torch.nn.Parameter]:
        return [self.flow.param_by_name[n] for n in bucket.names]

    def _holds(self, bucket: Bucket) -> bool:
        return all(p.numel() == self.flow.param_numel[n] for n, p in zip(bucket.names, self._params(bucket)))

    def launch(self, bucket: Bucket) -> None:
        if self.rank not in bucket.members:
            return
        t0 = time.perf_counter()
        params = self._params(bucket) if self._holds(bucket) else None
        in_place = False
        if params is None:   # a server without a replica: zeros in, the same sizes
            grad, values = torch.zeros(bucket.numel, device=self.device), None
        else:
            grad, in_place = _flat_gradients(params, bucket.method)
            server = self.servers.get(bucket.names)
            values = (torch.cat([p.detach().reshape(-1) for p in params])   # the server's first copy
                      if bucket.method is SyncMethod.PS and (server is None or server.needs_parameters) else None)
        self._pending.append((bucket, self._thread.submit(self._run, bucket, grad, values), in_place))
        self.sync_s += time.perf_counter() - t0

    def _run(self, bucket: Bucket, grad: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        if bucket.method is SyncMethod.PS:
            assert bucket.server is not None
            server = self.servers.get(bucket.names)
            if server is None:
                server = self.servers[bucket.names] = ParameterServer(
                    server=bucket.server, replicas=bucket.replicas, groups=self.groups,
                    make_optimizer=lambda ps: make_optimizer(ps, self.optimizer))
            return server.step(grad, values)
        allreduce_sum(grad, bucket.members, bucket.method, bucket.nodes, self.groups)
        return grad

    def finish(self) -> None:
        """Wait for every launched bucket (in launch order) and install its result."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for bucket, future, in_place in pending:
            try:
                flat = future.result()
            except RuntimeError as e:
                raise RankError(self.rank, f"gradient sync of {bucket.label} ({bucket.method}) with ranks "
                                           f"{list(bucket.members)} failed or timed out "
                                           f"({str(e).splitlines()[0]}).") from None
            if self._holds(bucket) and not in_place:     # in place: the gradient holds the sum
                self._install(bucket, flat)
        self.sync_s += time.perf_counter() - t0

    def _install(self, bucket: Bucket, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._params(bucket):
            n = p.numel()
            piece = flat[offset:offset + n].view_as(p)
            if bucket.method is SyncMethod.PS:   # the server's new parameters; nothing to step
                with torch.no_grad():
                    p.copy_(piece)
                p.grad = None
            else:   # a view: `flat` is this bucket's own buffer, made at launch (DDP's
                p.grad = piece          # gradient_as_bucket_view); a copy cost ~15 ms per 16.8 MB here
            offset += n

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _flat_gradients(params: Sequence[torch.nn.Parameter], method: SyncMethod) -> tuple[torch.Tensor, bool]:
    """A bucket's gradients as one flat tensor, and whether it *is* the gradient (summed in
    place, nothing to install). A one-parameter all-reduce bucket with a contiguous gradient
    (a tied embedding's copies) uses the gradient itself: copying it out and back cost ~30 ms
    per 16.8 MB step on this CPU (page faults of fresh buffers), unpaced executor work that no
    device in the plan does. Otherwise one concatenation (missing gradients as zeros)."""
    g = params[0].grad if len(params) == 1 else None
    if g is not None and method is not SyncMethod.PS and g.is_contiguous():
        return g.detach().view(-1), True
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                      for p in params]), False


class ProgramSync:
    """A lowered Program's driver: `launch(collective)` for each Collective instruction the
    rank reaches (bucket = the block's groups' parameters, tied ones excluded; or a tied
    parameter's copies), `finish()` before the optimizer step; `sum_tied_gradients()` once
    per step on every rank before the optimizer step, for the ties the Program has no
    Collective for (tables the capture does not list as ties)."""

    def __init__(self, *, program: Any, flow: Dataflow, rank: int, optimizer: str, timeout_s: float,
                 device: torch.device | None = None):
        self.program, self.flow, self.rank = program, flow, rank
        self.rank_of = program.rank_of()
        self.runner = BucketRunner(flow=flow, rank=rank, optimizer=optimizer, timeout_s=timeout_s, device=device)
        ranks_of_group: dict[int, list[int]] = {}
        for block in program.blocks:
            for g in block.groups:
                ranks_of_group[g] = [self.rank_of[d] for d in block.devices]
        self.ties = tie_buckets(flow, ranks_of_group)
        self._ties_done: set[str] = set()         # tied parameters synced by the Program this step
        sets = [self._bucket(c).members for c in self._collectives()] + [b.members for b in self.ties]
        self.runner.create_groups([Bucket(label="", names=(), numel=0, members=m, method=SyncMethod.RING)
                                   for m in sets])

    @property
    def sync_s(self) -> float:
        return self.runner.sync_s

    def _collectives(self) -> list[Any]:
        """Every Collective of the program, in one order all ranks share (device order)."""
        from heterog.lower.program import Collective
        seen: dict[int, Any] = {}
        for device in self.program.devices:
            for ins in self.program.instructions.get(device, ()):
                if isinstance(ins, Collective) and not ins.tie:
                    seen.setdefault(ins.block, ins)
        return [seen[b] for b in sorted(seen)]

    def _bucket(self, ins: Any) -> Bucket:
        block = self.program.blocks[ins.block]
        names = tuple(n for g in block.groups for n in self.flow.param_names.get(g, ())
                      if n not in self.flow.tied and n not in self.flow.unused)
        replicas = tuple(self.rank_of[d] for d in block.devices)
        members = tuple(self.rank_of[d] for d in ins.members)
        server = self.rank_of[ins.server] if ins.server else None
        if server is not None and server not in members:
            members += (server,)
        return Bucket(label=block.label, names=names, numel=sum(self.flow.param_numel[n] for n in names),
                      members=members, method=SyncMethod(ins.method), server=server, replicas=replicas,
                      nodes=tuple(tuple(self.rank_of[d] for d in node) for node in ins.nodes) or None)

    def launch(self, ins: Any) -> None:
        if ins.tie:                     # a tied parameter's copies, where the Program puts it
            bucket = self._tie(ins.tie, tuple(self.rank_of[d] for d in ins.members))
            self._ties_done.add(ins.tie)
        else:
            bucket = self._bucket(ins)
        if bucket.names:
            self.runner.launch(bucket)

    def _tie(self, name: str, members: tuple[int, ...]) -> Bucket:
        """The tie bucket of `name`, in the Program's ring order."""
        for b in self.ties:
            if b.names == (name,) and sorted(b.members) == sorted(members):
                return dataclasses.replace(b, members=members)
        raise RuntimeError(f"the program syncs tied parameter {name!r} over ranks {sorted(members)}, "
                           f"but this rank's partition holds its copies on "
                           f"{[sorted(b.members) for b in self.ties if b.names == (name,)] or 'no other rank'}; "
                           f"re-lower the plan for this model (`heterog lower`).")

    def finish(self) -> None:
        self.runner.finish()

    def sum_tied_gradients(self) -> None:
        """Before the optimizer step: the tied parameters the Program did not sync itself (a
        data-independent table recomputed in several groups, which the capture does not list
        as a tie), every rank in the same order."""
        for bucket in self.ties:
            if bucket.names[0] not in self._ties_done:
                self.runner.launch(bucket)
        self.runner.finish()
        self._ties_done.clear()
