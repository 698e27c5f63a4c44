"""Gradient synchronisation of replicated groups and tied parameters, by the Plan's method.

Each replica's loss is already scaled by its share of the global batch (samples / B, see
runtime.py), so the *sum* of the replicas' gradients is the global-batch gradient. Each
method runs its own code path (collectives.py): ring, tree and hierarchical all-reduce sum
the gradients on every member; a parameter server sums them on the server, which applies
the optimizer to its copy (it alone holds that state) and sends the parameters back — a
replica then installs them and clears the gradient, so its local optimizer skips them.

Parameters forward never reads have no gradient anywhere and are not synchronised (an
optimizer skips them, as in single-process training). Tied parameters (cut/partition.py: one
parameter read by several groups, e.g. an embedding and the output projection) are left out
of their groups' sync: every rank holding a copy adds its local gradient in one ring
all-reduce over all holders, then each holder steps its copy with the same gradient, so the
copies stay equal (Megatron-LM's embedding all-reduce).

A sync unit is a `Bucket`: parameter names (the same list on every rank), members in the
method's order, method, server and nodes. Buckets run on a *lane*, in the order they are
launched (the same on every rank), so they overlap the backward pass; each uses its own
sub-group, apart from the activation transfers (transport.py):
- CPU ranks (gloo): `ThreadLane`, one background thread, whose blocking waits leave the
  main thread computing;
- CUDA ranks (NCCL): `StreamLane`, a side CUDA stream. The collective's operations are
  enqueued by the main thread itself, in Program order, after an event that marks the
  gradients ready; NCCL's waits are stream waits, so the host never blocks and no second
  thread issues NCCL calls beside the main one (NCCL requires operations on its
  communicators to be ordered). The compute stream waits for the side stream only where
  the result is used (`finish`).

fp16 (`deferred=True`): a parameter server only gathers the gradient sum when its bucket is
launched; whether it applies the update is decided after every rank has checked its
gradients (device.LossScaler), and `pull_deferred` then applies it on every server, or skips
it on all of them (collectives.ParameterServer).

`ProgramSync` drives it from a lowered Program: one bucket per Collective instruction (a
block's parameters, or with `tie` a tied parameter's copies), launched when the rank's
interpreter reaches the instruction; a sharded block's reduce-scatters and all-gathers run
on the same lane through `ShardRunner` (shard.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from heterog.cut.dataflow import Dataflow
from heterog.errors import RankError
from heterog.execute.collectives import ParameterServer, ProcessGroupCache, allreduce_sum
from heterog.execute.lane_jobs import Job, LaneJobs
from heterog.execute.shard import ShardRunner, sharded_collectives
from heterog.ir.kinds import CollectiveOp, SyncMethod
from heterog.lower.program import Collective
from heterog.training import Recipe


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Parameters synchronised together by one collective."""

    label: str  # for errors: the groups or the tied parameter
    names: tuple[str, ...]
    numel: int
    members: tuple[int, ...]  # ranks, in the method's order (ring order)
    method: SyncMethod
    server: int | None = None
    replicas: tuple[int, ...] = ()  # ps: the ranks that compute gradients
    nodes: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Served:
    """A parameter server this rank runs: its parameters' names and sizes (in bucket order)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    server: ParameterServer


def tie_buckets(flow: Dataflow, ranks_of_group: Mapping[int, Sequence[int]]) -> list[Bucket]:
    """One ring all-reduce per tied parameter, over every rank that holds a copy."""
    out = []
    for name in sorted(flow.tied):
        members = sorted({r for g in flow.tied[name] for r in ranks_of_group[g]})
        if len(members) > 1:
            out.append(
                Bucket(
                    label=f"tied {name}",
                    names=(name,),
                    numel=flow.param_numel[name],
                    members=tuple(members),
                    method=SyncMethod.RING,
                )
            )
    return out


@dataclass(kw_only=True)
class _Done:
    """A StreamLane call's outcome (its operations enqueued; the value usable after a wait)."""

    value: Any = None
    error: BaseException | None = None


class ThreadLane:
    """CPU ranks: collectives on one background thread, in launch order."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heterog-sync")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def result(self, handle: Future) -> Any:
        return handle.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamLane:
    """CUDA ranks: collectives enqueued on a side stream by the calling thread (module
    docstring). `submit` orders the side stream after the compute stream's work so far and
    keeps the tensors it is given alive for the side stream; `result` makes the compute
    stream wait for the side stream."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Done:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for a in args:
            if isinstance(a, torch.Tensor):
                a.record_stream(self.stream)
        try:
            with torch.cuda.stream(self.stream):
                return _Done(value=fn(*args))
        except RuntimeError as e:
            return _Done(error=e)

    def result(self, handle: _Done) -> Any:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        if handle.error is not None:
            raise handle.error
        return handle.value

    def close(self) -> None:
        pass


def make_lane(device: torch.device, host_staging: bool) -> ThreadLane | StreamLane:
    """A stream on a CUDA rank that talks NCCL; a thread otherwise (CPU ranks, and CUDA ranks
    that share a GPU through gloo with host copies, whose waits block the host)."""
    return StreamLane(device) if device.type == "cuda" and not host_staging else ThreadLane()


class BucketRunner(LaneJobs):
    """Runs buckets on this rank: gathers gradients, syncs them on the lane, installs."""

    def __init__(
        self,
        *,
        flow: Dataflow,
        rank: int,
        optimizer: str | Recipe,
        timeout_s: float,
        device: torch.device | None = None,
        host_staging: bool = False,
        deferred: bool = False,
        clock: Any = None,
    ):
        self.flow, self.rank = flow, rank
        # the run's optimizer recipe (a plan's kind alone: its defaults); servers step with it
        self.recipe = optimizer if isinstance(optimizer, Recipe) else Recipe(kind=optimizer)
        self.schedulers: list[Any] = []  # the servers' learning-rate schedules
        self.device = device or torch.device("cpu")
        self.groups = ProcessGroupCache(timeout_s=timeout_s, host_staging=host_staging)
        self.servers: dict[tuple[str, ...], ParameterServer] = {}
        self.lane = make_lane(self.device, host_staging)
        self.deferred = deferred
        self.clock = clock
        self._pending: list[tuple[Bucket | Job, Any, bool]] = []
        self._gathered: list[Bucket] = []  # deferred: servers that hold a sum to apply
        # each collective's run on the lane: (label, start mark, end mark, the Program
        # instruction it carries out, or None for a sync the Program does not list)
        self.runs: list[tuple[str, Any, Any, int | None]] = []
        self.sync_s = 0.0

    def kept_buffers(self) -> list[torch.Tensor]:
        """The buffers kept from step to step: the collectives' receive buffers and each
        parameter server's (execute/collectives.py), for the emulated memory cap."""
        kept = list(self.groups.scratch.held.values())
        return kept + [s.buffer for s in self.servers.values() if s.buffer is not None]

    def create_groups(self, buckets: Sequence[Bucket]) -> None:
        self.groups.create_all([b.members for b in buckets])

    def create_servers(self, buckets: Sequence[Bucket]) -> None:
        """A ParameterServer for every ps bucket this rank is a member of (on the server, with
        its copy and optimizer), before the first step, so a resumed run can load its state."""
        for b in buckets:
            if b.method is SyncMethod.PS and self.rank in b.members and b.names not in self.servers:
                assert b.server is not None
                server = self.servers[b.names] = ParameterServer(
                    server=b.server,
                    replicas=b.replicas,
                    groups=self.groups,
                    numel=b.numel,
                    device=self.device,
                    make_optimizer=self.recipe.make_optimizer,
                    shapes=[self.flow.param_shape[n] for n in b.names],
                )
                if (sched := self.recipe.make_scheduler(server.optimizer)) is not None:
                    self.schedulers.append(sched)

    def _params(self, bucket: Bucket) -> list[torch.nn.Parameter]:
        return [self.flow.param_by_name[n] for n in bucket.names]

    def _holds(self, bucket: Bucket) -> bool:
        return all(p.numel() == self.flow.param_numel[n] for n, p in zip(bucket.names, self._params(bucket)))

    def launch(self, bucket: Bucket, index: int | None = None) -> None:
        """Start `bucket`'s sync on the lane; `index`: the Program instruction it carries out."""
        if self.rank not in bucket.members:
            self.nothing_to_run(bucket.label, index)
            return
        t0 = time.perf_counter()
        params = self._params(bucket) if self._holds(bucket) else None
        in_place = False
        if params is None:  # a server without a replica: zeros in, the same sizes
            grad, values = torch.zeros(bucket.numel, device=self.device), None
        else:
            grad, in_place = _flat_gradients(params, bucket.method)
            server = self.servers.get(bucket.names)
            values = (
                torch.cat([p.detach().reshape(-1) for p in params])  # the server's first copy
                if bucket.method is SyncMethod.PS and (server is None or server.needs_parameters)
                else None
            )
        self._pending.append((bucket, self.lane.submit(self._run, bucket, grad, values, index), in_place))
        self.sync_s += time.perf_counter() - t0

    def nothing_to_run(self, label: str, index: int | None) -> None:
        """A collective instruction with nothing to sync here (no parameters of its bucket on
        this rank): an empty run, so that every instruction has its span."""
        if self.clock is not None and index is not None:
            mark = self.clock.mark()
            self.runs.append((f"{label} (nothing to sync)", mark, mark, index))

    def _run(
        self, bucket: Bucket, grad: torch.Tensor, values: torch.Tensor | None, index: int | None
    ) -> torch.Tensor | None:
        start = self.clock.mark() if self.clock is not None else None
        out: torch.Tensor | None = grad
        if bucket.method is SyncMethod.PS:
            server = self.servers[bucket.names]
            if self.deferred:
                server.push(grad, values)
                out = None
            else:
                out = server.step(grad, values)
        else:
            allreduce_sum(grad, bucket.members, bucket.method, bucket.nodes, self.groups)
        if self.clock is not None:
            self.runs.append((f"{bucket.label} {bucket.method}", start, self.clock.mark(), index))
        return out

    def _result(self, bucket: Bucket | Job, handle: Any) -> Any:
        try:
            return self.lane.result(handle)
        except RuntimeError as e:
            raise RankError(
                self.rank,
                f"gradient sync of {bucket.label} ({bucket.method}) with ranks "
                f"{list(bucket.members)} failed or timed out "
                f"({str(e).splitlines()[0]}).",
            ) from None

    def finish(self) -> None:
        """Wait for every launched bucket (in launch order) and install its result."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for bucket, handle, in_place in pending:
            flat = self._result(bucket, handle)
            if isinstance(bucket, Job):  # it installed its own result
                continue
            if flat is None:  # deferred: the server's update comes later
                self._gathered.append(bucket)
            elif self._holds(bucket) and not in_place:  # in place: the gradient holds the sum
                self._install(bucket, flat)
        self.sync_s += time.perf_counter() - t0

    def unscale_and_check_servers(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """fp16: each gathered server's sum divided by the loss scale, overflow noted."""
        for bucket in self._gathered:
            self.servers[bucket.names].unscale_and_check(found_inf, inv_scale)

    def pull_deferred(self, apply: bool) -> None:
        """fp16: every gathered server applies its update and returns the parameters (apply),
        or none does (an overflow anywhere: the replicas keep theirs); in launch order."""
        gathered, self._gathered = self._gathered, []
        for bucket in gathered:
            if apply:
                flat = self._result(bucket, self.lane.submit(self.servers[bucket.names].pull))
                if self._holds(bucket):
                    self._install(bucket, flat)
            elif self._holds(bucket):
                for p in self._params(bucket):
                    p.grad = None

    def _install(self, bucket: Bucket, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._params(bucket):
            n = p.numel()
            piece = flat[offset : offset + n].view_as(p)
            if bucket.method is SyncMethod.PS:  # the server's new parameters; nothing to step
                with torch.no_grad():
                    p.copy_(piece)
                p.grad = None
            else:  # a view: `flat` is this bucket's own buffer, made at launch (DDP's
                p.grad = piece  # gradient_as_bucket_view); a copy cost ~15 ms per 16.8 MB here
            offset += n

    def close(self) -> None:
        self.lane.close()


def _flat_gradients(params: Sequence[torch.nn.Parameter], method: SyncMethod) -> tuple[torch.Tensor, bool]:
    """A bucket's gradients as one flat tensor, and whether it *is* the gradient (summed in
    place, nothing to install). A one-parameter all-reduce bucket with a contiguous gradient
    (a tied embedding's copies) uses the gradient itself: copying it out and back cost ~30 ms
    per 16.8 MB step on this CPU (page faults of fresh buffers), unpaced executor work that no
    device in the plan does. Otherwise one concatenation (missing gradients as zeros)."""
    g = params[0].grad if len(params) == 1 else None
    if g is not None and method is not SyncMethod.PS and g.is_contiguous():
        return g.detach().view(-1), True
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params]
    ), False


class ProgramSync:
    """A lowered Program's driver: `launch(collective)` for each Collective instruction the
    rank reaches (bucket = the block's groups' parameters, tied ones excluded; or a tied
    parameter's copies), `finish()` before the optimizer step; `sum_tied_gradients()` once
    per step on every rank before the optimizer step, for the ties the Program has no
    Collective for (tables the capture does not list as ties)."""

    def __init__(
        self,
        *,
        program: Any,
        flow: Dataflow,
        rank: int,
        optimizer: str | Recipe,
        timeout_s: float,
        device: torch.device | None = None,
        host_staging: bool = False,
        deferred: bool = False,
        clock: Any = None,
        mirrors: Sequence[dict[int, int]] = (),
    ):
        """mirrors: a tensor-parallel member's map of its sibling's ranks to every sibling's
        (tp_rank.sibling_ranks): the sub-groups of every sibling are created, in one order on
        every rank."""
        self.program, self.flow, self.rank = program, flow, rank
        self.rank_of = program.rank_of()
        self.runner = BucketRunner(
            flow=flow,
            rank=rank,
            optimizer=optimizer,
            timeout_s=timeout_s,
            device=device,
            host_staging=host_staging,
            deferred=deferred,
            clock=clock,
        )
        ranks_of_group: dict[int, list[int]] = {}
        for block in program.blocks:
            for g in block.groups:
                ranks_of_group[g] = [self.rank_of[d] for d in block.devices]
        self.ties = tie_buckets(flow, ranks_of_group)
        self._ties_done: set[str] = set()  # tied parameters synced by the Program this step
        sharded = [tuple(self.rank_of[d] for d in c.members) for _, c in sorted(sharded_collectives(program).items())]
        sets = [self._bucket(c).members for c in self._collectives()] + [b.members for b in self.ties] + sharded
        if mirrors:  # each sibling lists its devices in its own order: sort, to agree on every rank
            sets = sorted({tuple(sorted(m[r] for r in s)) for m in mirrors for s in sets})
        self.runner.create_groups(
            [Bucket(label="", names=(), numel=0, members=m, method=SyncMethod.RING) for m in sets]
        )
        self.runner.create_servers([b for c in self._collectives() if (b := self._bucket(c)).names])
        self.shards = ShardRunner(program=program, flow=flow, rank=rank, rank_of=self.rank_of, runner=self.runner)
        self.deferred = deferred

    def served(self) -> list[Served]:
        """The ps buckets this rank serves, with their servers."""
        return [s for s in self.ps_buckets() if s.server.server == self.rank]

    def ps_buckets(self) -> list[Served]:
        """Every ps bucket this rank serves or is a replica of, with its server: a checkpoint
        saves and loads their optimizer state through the server only (execute/checkpoint.py)."""
        out = []
        for c in self._collectives():
            b = self._bucket(c)
            server = self.runner.servers.get(b.names)
            if server is not None and b.names:
                out.append(
                    Served(names=b.names, server=server, shapes=tuple(self.flow.param_shape[n] for n in b.names))
                )
        return out

    @property
    def sync_s(self) -> float:
        return self.runner.sync_s

    def _collectives(self) -> list[Any]:
        """Every Collective of the program, in one order all ranks share (device order)."""
        seen: dict[int, Any] = {}
        for device in self.program.devices:
            for ins in self.program.instructions.get(device, ()):
                if isinstance(ins, Collective) and not ins.tie and ins.primitive is CollectiveOp.ALL_REDUCE:
                    seen.setdefault(ins.block, ins)
        return [seen[b] for b in sorted(seen)]

    def _bucket(self, ins: Any) -> Bucket:
        block = self.program.blocks[ins.block]
        names = tuple(
            n
            for g in block.groups
            for n in self.flow.param_names.get(g, ())
            if n not in self.flow.tied and n not in self.flow.unused
        )
        replicas = tuple(self.rank_of[d] for d in block.devices)
        members = tuple(self.rank_of[d] for d in ins.members)
        server = self.rank_of[ins.server] if ins.server else None
        if server is not None and server not in members:
            members += (server,)
        return Bucket(
            label=block.label,
            names=names,
            numel=sum(self.flow.param_numel[n] for n in names),
            members=members,
            method=SyncMethod(ins.method),
            server=server,
            replicas=replicas,
            nodes=tuple(tuple(self.rank_of[d] for d in node) for node in ins.nodes) or None,
        )

    def launch(self, ins: Any, index: int | None = None) -> None:
        """Start the sync of Collective instruction `ins` (at `index` in this rank's list)."""
        if ins.primitive is not CollectiveOp.ALL_REDUCE:  # a sharded block's (shard.py)
            self.shards.launch(ins, index, deferred=self.deferred)
            return
        if ins.tie:  # a tied parameter's copies, where the Program puts it
            bucket = self._tie(ins.tie, tuple(self.rank_of[d] for d in ins.members))
            self._ties_done.add(ins.tie)
        else:
            bucket = self._bucket(ins)
        if bucket.names:
            self.runner.launch(bucket, index)
        else:
            self.runner.nothing_to_run(bucket.label, index)

    def _tie(self, name: str, members: tuple[int, ...]) -> Bucket:
        """The tie bucket of `name`, in the Program's ring order."""
        for b in self.ties:
            if b.names == (name,) and sorted(b.members) == sorted(members):
                return dataclasses.replace(b, members=members)
        raise RuntimeError(
            f"the program syncs tied parameter {name!r} over ranks {sorted(members)}, "
            f"but this rank's partition holds its copies on "
            f"{[sorted(b.members) for b in self.ties if b.names == (name,)] or 'no other rank'}; "
            f"re-lower the plan for this model (`heterog lower`)."
        )

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
