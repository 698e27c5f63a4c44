"""Plan: a deployment strategy, the only thing the search emits and the executor obeys.

Vocabulary (README.md, "Words"): the OpGraph's nodes are partitioned into *groups*; each group has a
*placement*, a tuple of *replicas* (device, share of every micro-batch); a replicated group's
gradients are synchronised by `sync`. One replica with share 1.0 is model parallelism; all
devices is data parallelism; a subset is hybrid.

A replicated group may shard its state across its replicas (`shard_stage`, ZeRO-1/2/3): each
replica then holds the fraction `Replica.shard` of it, chosen apart from its share of the
batch, so a fast device with little memory can take much of the batch and little of the state
(Cephalo, ICS'25). Schema version 2 added the shard fields; a version-1 plan loads unsharded.

A replica may be a tensor-parallel set of devices (`Replica.tp_devices`: the members beside
`device`, in rank order): Megatron-LM's split of the group's transformer blocks over 2, 4 or 8
devices (cost/tensor_parallel.py), `device` its first rank. Every replica of a group has the
same degree (its data-parallel sync runs among same-rank members); groups may differ. Schema
version 3 added it; older plans load with every replica on one device.

A replica may run its share of every micro-batch as `Replica.accumulate` sequential pieces
(ir/accumulation.py); a group's optional JSON field `accumulate`, written when some count ≠ 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from heterog.errors import ArtifactError, PlanError
from heterog.ir.accumulation import accumulate_field, accumulation_error, with_accumulation
from heterog.ir.kinds import PipelineSchedule, Precision, ShardStage, SyncMethod
from heterog.ir.model_file import file_sha256 as file_sha256  # re-exported: callers import it from here
from heterog.ir.model_file import portable_model, register_model_file, resolve_model
from heterog.ir.model_file import user_model_file as user_model_file
from heterog.jsonio import Artifact

SCHEMA_VERSION = 3  # 2: shard_stage per group, a shard fraction per replica; 3: tensor-parallel members
KIND = "heterog.Plan"

SYNC_METHODS = tuple(SyncMethod)
SCHEDULES = tuple(PipelineSchedule)
PRECISIONS = tuple(Precision)
OPTIMIZERS = ("sgd", "adamw")
SHARE_TOLERANCE = 1e-6
TP_DEGREES = (1, 2, 4, 8)  # Megatron's degrees within a node (cost/tensor_parallel.py DEGREES)
IN_MEMORY_PREFIX = "in-memory:"  # the model name of a plan made from an nn.Module object


K = TypeVar("K", bound=StrEnum)


def _kind(kind: type[K], value: str, what: str) -> K:
    """`value` as a member of `kind` (a plan written as JSON holds the strings), or a PlanError
    naming the choices."""
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{what} {value!r} is not one of {', '.join(kind)}.") from None


def in_memory_model_error(name: str) -> str | None:
    """Why a plan of an in-memory module cannot be rebuilt in another process, or None."""
    if not name.startswith(IN_MEMORY_PREFIX):
        return None
    return (
        f"the plan was made for an in-memory nn.Module ({name!r}); its ranks would have to rebuild "
        f"that module in other processes, which cannot see it. Put the module in a file — "
        f"factory(**args) and example_batch(batch_size) — and plan 'path/file.py:factory' "
        f"(docs/robustness.md)."
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Replica:
    device: str
    share: float  # fraction of every micro-batch this replica computes
    shard: float | None = None  # fraction of the group's sharded state it holds (sharded groups)
    tp_devices: tuple[str, ...] = ()  # the other members of its tensor-parallel set, in rank order
    accumulate: int = 1  # sequential pieces its share of every micro-batch runs in, gradients added

    @property
    def members(self) -> tuple[str, ...]:
        """Every device of the replica, its first rank (`device`) first."""
        return (self.device, *self.tp_devices)

    @property
    def tp_degree(self) -> int:
        return 1 + len(self.tp_devices)


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    name: str
    nodes: tuple[str, ...]  # OpGraph node names, in graph order
    replicas: tuple[Replica, ...]
    sync: SyncMethod = SyncMethod.NONE  # how gradients of a replicated group are combined
    ps_device: str | None = None  # the parameter server, when sync is ps
    recompute: bool = False  # recompute activations in backward instead of saving them
    shard_stage: int = ShardStage.NONE  # ZeRO stage: what the replicas shard (ir/kinds.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sync", _kind(SyncMethod, self.sync, f"group {self.name!r}: sync"))

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(r.device for r in self.replicas)

    @property
    def tp_degree(self) -> int:
        """The tensor-parallel degree of its replicas (validate: all alike)."""
        return self.replicas[0].tp_degree if self.replicas else 1

    @property
    def shards(self) -> tuple[float, ...]:
        """Each replica's fraction of the sharded state (empty when the group is not sharded)."""
        return tuple(r.shard or 0.0 for r in self.replicas) if self.shard_stage else ()

    def validate(self) -> None:
        """Check the group alone: nodes, replicas and shares, sync method and server."""
        where = f"group {self.name!r}"
        if not self.nodes:
            raise PlanError(f"{where}: holds no nodes.")
        if not self.replicas:
            raise PlanError(f"{where}: has no replicas; place it on at least one device.")
        devs = [d for r in self.replicas for d in r.members]
        if len(set(devs)) != len(devs):
            raise PlanError(f"{where}: a device appears twice in its replicas ({devs}).")
        self._validate_tensor_parallel(where)
        for r in self.replicas:
            if not (r.share > 0 and math.isfinite(r.share)):
                raise PlanError(f"{where} replica on {r.device!r}: share must be > 0, found {r.share}.")
        total = sum(r.share for r in self.replicas)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise PlanError(
                f"{where}: replica shares sum to {total:.6g}, not 1; shares are fractions of each micro-batch."
            )
        if self.sync == SyncMethod.PS and self.ps_device is None:
            raise PlanError(
                f"{where}: sync is 'ps' but ps_device is not set; name the device that holds the parameter server."
            )
        if self.sync != SyncMethod.PS and self.ps_device is not None:
            raise PlanError(f"{where}: ps_device is set but sync is {str(self.sync)!r}, not 'ps'.")
        self._validate_shards(where)

    def _validate_tensor_parallel(self, where: str) -> None:
        degrees = sorted({r.tp_degree for r in self.replicas})
        if len(degrees) > 1:
            raise PlanError(
                f"{where}: its replicas have tensor-parallel degrees {degrees}; give every replica of a "
                f"group the same degree (the gradient sync runs among same-rank members), or split the group."
            )
        if degrees[0] not in TP_DEGREES:
            raise PlanError(
                f"{where}: tensor-parallel degree {degrees[0]} is not supported; use one of {TP_DEGREES} "
                f"(1 + the number of tp_devices of each replica)."
            )
        if degrees[0] > 1 and self.sync == SyncMethod.PS:
            raise PlanError(
                f"{where}: a parameter server between tensor-parallel replicas is not modelled; sync them by 'ring'."
            )

    def _validate_shards(self, where: str) -> None:
        if self.shard_stage not in tuple(ShardStage):
            raise PlanError(
                f"{where}: shard_stage {self.shard_stage!r} is not one of 0 (none), 1 (optimizer "
                f"state), 2 (+ gradients), 3 (+ parameters)."
            )
        given = [r.shard is not None for r in self.replicas]
        if not self.shard_stage:
            if any(given):
                raise PlanError(
                    f"{where}: replicas give shard fractions but shard_stage is 0; set "
                    f"shard_stage 1-3 to shard the group's state, or drop the fractions."
                )
            return
        if len(self.replicas) < 2:
            raise PlanError(
                f"{where}: shard_stage {self.shard_stage} needs at least two replicas to shard "
                f"across; it has one. Set shard_stage 0."
            )
        if self.sync != SyncMethod.RING:
            raise PlanError(
                f"{where}: a sharded group synchronises by ring reduce-scatter and all-gather, "
                f"but its sync is {str(self.sync)!r}; set sync 'ring' (or shard_stage 0)."
            )
        if not all(given):
            missing = [r.device for r in self.replicas if r.shard is None]
            raise PlanError(
                f"{where}: shard_stage {self.shard_stage} but replica(s) {missing} give no shard "
                f"fraction; give every replica the fraction of the state it holds (summing to 1)."
            )
        for r in self.replicas:
            if not (r.shard is not None and r.shard >= 0 and math.isfinite(r.shard)):
                raise PlanError(f"{where} replica on {r.device!r}: shard must be ≥ 0, found {r.shard}.")
        total = sum(self.shards)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise PlanError(
                f"{where}: replica shard fractions sum to {total:.6g}, not 1; each is the "
                f"fraction of the group's state that replica holds."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What to capture to rebuild the graph the plan was made for."""

    name: str  # zoo name or 'path/file.py:factory'
    args: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1
    seq_len: int | None = None
    file: str | None = None  # user model file: relative to the plan file on disk
    file_sha256: str | None = None  # its content hash, when saved to disk


DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb


@dataclass(frozen=True, kw_only=True)
class Plan(Artifact, kind=KIND, version=SCHEMA_VERSION, older=(1, 2)):
    strategy: str  # 'even-dp-allreduce', 'search', ... (see search/)
    model: ModelSpec
    precision: Precision = Precision.FP32
    optimizer: str = "sgd"
    groups: tuple[Group, ...]
    num_microbatches: int = 1
    schedule: PipelineSchedule = PipelineSchedule.GPIPE
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # gradient bucket size for overlapping sync with backward
    priorities: dict[str, float] = field(default_factory=dict)  # node → priority; higher first
    cluster: dict[str, Any] = field(default_factory=dict)  # the cluster spec (self-contained)
    graph_fingerprint: str = ""
    cluster_fingerprint: str = ""
    predicted_iteration_time_s: float | None = None
    predicted_peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    # usd_per_hour, usd_per_step, usd_per_million_samples (and _tokens): search/objective.py; {} unpriced
    predicted_cost: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # the explanation: why this plan

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", _kind(Precision, self.precision, "precision"))
        object.__setattr__(self, "schedule", _kind(PipelineSchedule, self.schedule, "schedule"))

    @property
    def batch_size(self) -> int:
        return self.model.batch_size

    def devices(self) -> tuple[str, ...]:
        """Every device the plan uses, in first-use order."""
        seen: dict[str, None] = {}
        for g in self.groups:
            for r in g.replicas:
                seen.setdefault(r.device, None)
                for d in r.tp_devices:
                    seen.setdefault(d, None)
        return tuple(seen)

    @property
    def tensor_parallel(self) -> bool:
        """True when some group splits its blocks over several devices (a group's replicas
        share one degree, Group.validate; reading the first keeps this cheap at 1024 replicas)."""
        return any(g.replicas and g.replicas[0].tp_devices for g in self.groups)

    def microbatch_size(self, index: int) -> int:
        """Samples in micro-batch `index`; the batch is split as evenly as integers allow."""
        return split_samples(self.batch_size, [1.0] * self.num_microbatches)[index]

    def replica_samples(self, group: Group, microbatch: int) -> list[int]:
        """Integer samples of each replica of `group` in one micro-batch (largest remainder)."""
        return split_samples(self.microbatch_size(microbatch), [r.share for r in group.replicas])

    def with_prediction(self, iteration_time_s: float, peak_memory_bytes: dict[str, int]) -> Plan:
        return replace(
            self, predicted_iteration_time_s=iteration_time_s, predicted_peak_memory_bytes=dict(peak_memory_bytes)
        )

    # -- validation -----------------------------------------------------------------------
    def validate(self, graph=None, cluster=None, checked: Callable[[Group], bool] | None = None) -> Plan:
        """Check the plan alone, and against a graph and cluster when given. checked(g): True
        for a group validated before (groups are frozen; the search re-uses unchanged ones)."""
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")
        if self.model.batch_size < 1:
            raise PlanError(f"model.batch_size must be ≥ 1, found {self.model.batch_size}.")
        if not 1 <= self.num_microbatches <= self.model.batch_size:
            raise PlanError(
                f"num_microbatches must lie in 1..batch_size ({self.model.batch_size}), found {self.num_microbatches}."
            )
        if not self.groups:
            raise PlanError("the plan has no groups; every graph node must belong to one group.")
        why = accumulation_error(self)
        if why:
            raise PlanError(why)
        names: set[str] = set()
        for g in self.groups:
            if g.name in names:
                raise PlanError(f"group {g.name!r}: duplicate group name.")
            names.add(g.name)
            if checked is None or not checked(g):
                g.validate()
            if len(g.replicas) > 1 and g.sync == SyncMethod.NONE and graph is not None:
                if any(graph.node(n).param_count for n in g.nodes if n in graph.index):
                    raise PlanError(
                        f"group {g.name!r}: replicated on {len(g.replicas)} devices and holds "
                        f"parameters, but sync is 'none'; its replicas would diverge. "
                        f"Choose ring, tree, hierarchical or ps."
                    )
        if cluster is not None:
            known = set(cluster.device_index)
            for g in self.groups:
                members = [d for r in g.replicas for d in r.members]
                for d in [*members, *([g.ps_device] if g.ps_device else [])]:
                    if d not in known:
                        raise PlanError(f"group {g.name!r}: device {d!r} is not in cluster {cluster.name!r}.")
            if self.cluster_fingerprint and self.cluster_fingerprint != cluster.fingerprint():
                raise PlanError(
                    f"the plan was made for a different cluster (fingerprint "
                    f"{self.cluster_fingerprint}, this one {cluster.fingerprint()}): was the "
                    f"plan's cluster edited after planning? Re-plan for this cluster."
                )
        if graph is not None:
            owner: dict[str, str] = {}
            for g in self.groups:
                for n in g.nodes:
                    if n not in graph.index:
                        raise PlanError(f"group {g.name!r}: node {n!r} is not in the graph of {graph.model}.")
                    if n in owner:
                        raise PlanError(f"node {n!r} is in two groups ({owner[n]!r} and {g.name!r}).")
                    owner[n] = g.name
            missing = [n.name for n in graph.nodes if n.name not in owner]
            if missing:
                raise PlanError(
                    f"{len(missing)} graph node(s) belong to no group, e.g. {missing[:3]}; "
                    f"every node must be in exactly one group."
                )
            if self.graph_fingerprint and self.graph_fingerprint != graph.fingerprint():
                raise PlanError(
                    f"the plan was made for a different model graph (fingerprint "
                    f"{self.graph_fingerprint}, this one {graph.fingerprint()})."
                )
        return self

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "model":
                v = {
                    "name": v.name,
                    "args": v.args,
                    "batch_size": v.batch_size,
                    "seq_len": v.seq_len,
                    **({"file": v.file, "file_sha256": v.file_sha256} if v.file else {}),
                }
            elif f.name == "groups":
                v = [
                    {
                        "name": g.name,
                        "nodes": list(g.nodes),
                        "replicas": [
                            [r.device, r.share] if r.shard is None else [r.device, r.share, r.shard] for r in g.replicas
                        ],
                        "sync": g.sync,
                        "ps_device": g.ps_device,
                        "recompute": g.recompute,
                        "shard_stage": int(g.shard_stage),
                        **({"tp_devices": [list(r.tp_devices) for r in g.replicas]} if g.tp_degree > 1 else {}),
                        **accumulate_field(g),
                    }
                    for g in v
                ]
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def save(self, path) -> None:
        """Write the plan; a user model file is recorded relative to the plan file, with its
        content hash, so the plan can be used from another folder or node (portable_model)."""
        Artifact.save(replace(self, model=portable_model(self.model, Path(path).parent)), path)

    @classmethod
    def load(cls, path) -> Plan:
        plan = super().load(path)
        return replace(plan, model=resolve_model(plan.model, Path(path).parent, source=str(path)))

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "<plan>") -> Plan:
        try:
            m = doc["model"]
            groups = []
            for i, g in enumerate(doc["groups"]):
                where = f"{source}: group {i} ({g.get('name', '?')!r})"
                try:
                    replicas = _with_members(tuple(_replica(r) for r in g["replicas"]), g.get("tp_devices"))
                    replicas = with_accumulation(replicas, g.get("accumulate"))
                except (TypeError, ValueError):
                    raise PlanError(
                        f"{where}: replicas must be [[device, share], ...] or, in a sharded group, "
                        f"[[device, share, shard], ...], tp_devices (when given) one list of device "
                        f"names per replica, and accumulate (when given) one integer ≥ 1 per replica; "
                        f"found {g.get('replicas')!r}, {g.get('tp_devices')!r}, {g.get('accumulate')!r}."
                    ) from None
                groups.append(
                    Group(
                        name=g["name"],
                        nodes=tuple(g["nodes"]),
                        replicas=replicas,
                        sync=g.get("sync", "none"),
                        ps_device=g.get("ps_device"),
                        recompute=bool(g.get("recompute", False)),
                        shard_stage=int(g.get("shard_stage", 0)),
                    )
                )
            known = {f.name for f in fields(Plan)}
            rest = {k: v for k, v in doc.items() if k in known and k not in ("model", "groups")}
            for k in ("notes",):
                if k in rest:
                    rest[k] = tuple(rest[k])
            plan = Plan(
                model=ModelSpec(
                    name=m["name"],
                    args=m.get("args", {}),
                    batch_size=m["batch_size"],
                    seq_len=m.get("seq_len"),
                    file=m.get("file"),
                    file_sha256=m.get("file_sha256"),
                ),
                groups=tuple(groups),
                **rest,
            )
        except KeyError as e:
            raise PlanError(f"{source}: missing field {e.args[0]!r}.") from None
        except (TypeError, AttributeError, ValueError) as e:
            raise PlanError(f"{source}: malformed plan ({e}).") from None
        except PlanError as e:  # a kind that is not one of its choices
            raise PlanError(f"{source}: {e}") from None
        except ArtifactError:
            raise
        register_model_file(plan.model)
        try:
            return plan.validate()
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None


def _replica(entry: list) -> Replica:
    """A replica from its JSON list: [device, share] or [device, share, shard]."""
    if not 2 <= len(entry) <= 3:
        raise ValueError(entry)
    device, share, *shard = entry
    return Replica(device=device, share=float(share), shard=float(shard[0]) if shard else None)


def _with_members(replicas: tuple[Replica, ...], tp_devices: list | None) -> tuple[Replica, ...]:
    """The replicas with their tensor-parallel members from the group's `tp_devices` list."""
    if tp_devices is None:
        return replicas
    if len(tp_devices) != len(replicas) or not all(isinstance(m, list) for m in tp_devices):
        raise ValueError(tp_devices)
    return tuple(replace(r, tp_devices=tuple(str(d) for d in m)) for r, m in zip(replicas, tp_devices, strict=True))


def split_samples(total: int, shares: list[float]) -> list[int]:
    """Integer parts of `total` proportional to `shares`, summing to `total` (largest remainder).

    The simulator and the executor both use this, so they agree on every replica's samples.
    """
    s = sum(shares)
    exact = [total * x / s for x in shares]
    counts = [int(math.floor(e)) for e in exact]
    rest = total - sum(counts)
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def shard_ranges(total: int, fractions: tuple[float, ...] | list[float]) -> list[tuple[int, int]]:
    """[lo, hi) of each member's piece of a flat buffer of `total` elements: contiguous, in
    ring order, sized by the fractions (largest remainder, as samples are split)."""
    out, lo = [], 0
    for n in split_samples(total, list(fractions)) if total else [0] * len(fractions):
        out.append((lo, lo + n))
        lo += n
    return out


def shard_piece(op: str, position: Any, step: Any, n: int) -> Any:
    """The piece the ring member at `position` sends at `step` (0 … n−2) of a reduce-scatter
    or all-gather whose member i owns piece i (execute/collectives.py runs the same rule): a
    reduce-scatter passes on the partial sum of piece i−k−1, so after n−1 steps member i holds
    the total of piece i; an all-gather passes on piece i−k, its own first. Ints give an int;
    integer arrays (cost/comm.py: every member at every step at once) give the array."""
    return (position - step - (1 if op == "reduce_scatter" else 0)) % n
