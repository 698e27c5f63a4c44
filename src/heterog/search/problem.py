"""The search's view of one planning problem: grouped costs as tables, and strategies.

Every cost the search needs is read from the CostModel once, here: per group and per device
class (devices of one GPU type, slowdown and memory behave alike, so a 1024-GPU cluster of
four types costs four look-ups, not 1024) the forward/backward time as an Affine in the batch,
optimizer time, persistent and activation memory; per group its gradient bytes; per pair of
groups the activation bytes between them. A `Strategy` is the search's compact plan
(device indices instead of names); `to_plan` turns it into the Plan artifact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import numpy as np

from heterog.cost.model import CostModel
from heterog.hardware.cluster import Cluster
from heterog.ir.accumulation import without_stray_counts
from heterog.ir.affine import Affine
from heterog.ir.kinds import Phase, PipelineSchedule, Precision, SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import DEFAULT_BUCKET_BYTES, Group, ModelSpec, Plan, Replica, split_samples
from heterog.lower.context import SimCache, device_class_key
from heterog.lower.tensor_parallel import TensorParallelSupport
from heterog.search.constraints import ModelCuts
from heterog.search.grouping import group_graph

SYNC_CHOICES = (SyncMethod.RING, SyncMethod.TREE, SyncMethod.HIERARCHICAL, SyncMethod.PS)
BUCKET_BYTES = DEFAULT_BUCKET_BYTES  # gradient bucket of the plans we emit


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one group runs: device indices (sorted), each one's share, how gradients sync,
    the state its replicas shard (ZeRO stage, each replica's fraction of the state), and
    each replica's tensor-parallel members beside it (`tp`: empty, or one tuple of device
    indices per replica, all of one length; search/tp_moves.py).

    Hashed once, when made: a 1024-device placement is a key of the search's caches and of
    every strategy's identity, and rehashing its tuples per look-up cost more than scoring."""

    devices: tuple[int, ...]
    shares: tuple[float, ...]
    sync: SyncMethod = SyncMethod.NONE
    ps: int | None = None
    recompute: bool = False
    shard: int = 0
    shards: tuple[float, ...] = ()
    accumulate: tuple[int, ...] = ()  # each replica's accumulation pieces (ir/accumulation.py); () all 1
    tp: tuple[tuple[int, ...], ...] = ()
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        assert len(self.devices) == len(self.shares) and self.devices, self
        assert abs(sum(self.shares) - 1.0) < 1e-6, self.shares
        assert not self.shard or (len(self.shards) == len(self.devices) and abs(sum(self.shards) - 1.0) < 1e-6), self
        assert not self.accumulate or len(self.accumulate) == len(self.devices), self
        assert not self.tp or (len(self.tp) == len(self.devices) and len({len(m) for m in self.tp}) == 1), self
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def tp_degree(self) -> int:
        return 1 + len(self.tp[0]) if self.tp else 1


@dataclass(frozen=True, slots=True)
class Strategy:
    placements: tuple[Placement, ...]
    microbatches: int = 1
    schedule: PipelineSchedule = (
        PipelineSchedule.GPIPE
    )  # or '1f1b': same bubble, fewer micro-batches in flight per stage
    # gradient bucket (lower/blocks.gradient_buckets): small ones start the sync of the last
    # layers' gradients early in the backward and leave the least after it; each is a collective
    bucket_bytes: int = BUCKET_BYTES

    def key(self) -> tuple:
        """Identity for de-duplication: placements compare by value and hash once (Placement)."""
        return (self.microbatches, self.schedule, self.bucket_bytes, self.placements)


def device_tiers(cluster: Cluster) -> list[tuple[int, ...]]:
    """The search's device *tiers*: devices the cost model cannot tell apart (one class,
    lower/context.device_class_key) on nodes with equal NICs, latencies and device counts, so
    that transfers between two tiers cost alike whichever of their devices they join. At
    hundreds of devices the search moves whole tiers first (a 1024-GPU cluster of four types
    is four tiers), then single devices. Each tier lists its devices node by node, so its
    first k devices fill whole nodes."""
    node = {n.name: n for n in cluster.nodes}
    keys: dict[tuple, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        n = node[d.node]
        k = (
            device_class_key(cluster, d.name),
            n.nic_bandwidth_bytes_per_s,
            n.nic_latency_s,
            n.intra_latency_s,
            len(n.devices),
        )
        keys.setdefault(k, []).append(i)
    order = {n.name: i for i, n in enumerate(cluster.nodes)}
    return [tuple(sorted(v, key=lambda i: (order[cluster.devices[i].node], i))) for v in keys.values()]


def _fit(t_lo: float, t_hi: float, b_lo: float, b_hi: float) -> Affine:
    if b_hi == b_lo:
        return Affine(0.0, t_hi / b_hi)
    a = Affine.fit(b_lo, t_lo, b_hi, t_hi)
    # a time never falls with the batch, nor is it negative at zero samples
    return Affine(max(a.fixed, 0.0), max(a.per_sample, 0.0))


@dataclass(kw_only=True)
class Problem:
    graph: OpGraph
    cluster: Cluster
    costs: CostModel
    groups: list[tuple[str, ...]]
    batch_size: int
    model_spec: ModelSpec | None = None
    precision: str = "fp32"
    optimizer: str = "sgd"
    extra: dict = field(default_factory=dict)
    cuts: ModelCuts | None = None  # what the executor can cut (search/constraints.py)
    # how far the search may split groups by tensor parallelism (tp_moves.py)
    tensor_parallel: TensorParallelSupport = TensorParallelSupport.NONE
    sim_cache: SimCache = field(default_factory=SimCache)  # the simulator's, kept across candidates

    def __post_init__(self) -> None:
        c = self.cluster
        self.device_names = [d.name for d in c.devices]
        self.n_devices = len(self.device_names)
        self.memory_bytes = np.array([float(c.memory_bytes(d)) for d in self.device_names])
        classes: dict[tuple, int] = {}
        self.dev_class = np.zeros(self.n_devices, dtype=np.int64)
        self.class_rep: list[str] = []
        for i, d in enumerate(c.devices):
            k = device_class_key(c, d.name)
            if k not in classes:
                classes[k] = len(self.class_rep)
                self.class_rep.append(d.name)
            self.dev_class[i] = classes[k]
        self.node_of_device = [c.node_of[d] for d in self.device_names]
        node_pos = {n.name: i for i, n in enumerate(c.nodes)}
        self.node_idx = np.array([node_pos[x] for x in self.node_of_device], dtype=np.int64)
        self.tiers = device_tiers(c)
        self.tier_of = np.zeros(self.n_devices, dtype=np.int64)
        for t, devs in enumerate(self.tiers):
            self.tier_of[list(devs)] = t
        # seconds per byte through each node's NIC (one direction); transfers that leave or
        # enter a node share it, which the search's estimate models as one queue per direction
        self.nic_s_per_byte = np.array([1.0 / n.nic_bandwidth_bytes_per_s for n in c.nodes])
        G, C = len(self.groups), len(self.class_rep)
        B = float(self.batch_size)
        b_lo = max(1.0, B / 8.0)
        self.fwd = np.zeros((G, C, 2))  # [..., 0] fixed time, [..., 1] time per sample
        self.bwd = np.zeros((G, C, 2))
        self.opt_time_s = np.zeros((G, C))
        self.accumulate_time_s = np.zeros((G, C))  # a later micro-batch's backward adds its gradients
        self.persistent_bytes = np.zeros((G, C))
        self.act_per_sample = np.zeros((G, 2))  # without / with recompute
        self.workspace_per_sample = np.zeros(G)
        self.grad_bytes = np.zeros(G)
        self.flops_per_sample = np.zeros(G)
        self.param_bytes = np.zeros(G)
        nodes = {n.name: n for n in self.graph.nodes}
        for g, names in enumerate(self.groups):
            for ci, rep in enumerate(self.class_rep):
                for arr, phase in ((self.fwd, Phase.FORWARD), (self.bwd, Phase.BACKWARD)):
                    lo = sum(self.costs.compute_time_s(n, rep, b_lo, phase) for n in names)
                    hi = sum(self.costs.compute_time_s(n, rep, B, phase) for n in names)
                    a = _fit(lo, hi, b_lo, B)
                    arr[g, ci] = (a.fixed, a.per_sample)
                self.opt_time_s[g, ci] = self.costs.optimizer_time_s(names, rep)
                self.accumulate_time_s[g, ci] = self.costs.accumulate_time_s(names, rep)
                self.persistent_bytes[g, ci] = self.costs.persistent_bytes(names, rep)
            self.act_per_sample[g, 0] = self.costs.activation_bytes(names, B, False) / B
            self.act_per_sample[g, 1] = self.costs.activation_bytes(names, B, True) / B
            self.workspace_per_sample[g] = self.costs.workspace_bytes(names, B) / B
            self.grad_bytes[g] = self.costs.gradient_bytes(names)
            self.flops_per_sample[g] = sum(nodes[n].fwd_flops.at(B) + nodes[n].bwd_flops.at(B) for n in names) / B
            self.param_bytes[g] = sum(nodes[n].param_bytes for n in names)
        self.edges = {k: v for k, v in group_graph(self.graph, self.groups).items()}
        self.preds: list[list[int]] = [[] for _ in range(G)]
        self.succs: list[list[int]] = [[] for _ in range(G)]
        for src, dst in self.edges:
            self.preds[dst].append(src)
            self.succs[src].append(dst)
        self._pair_cache: dict[tuple, tuple[float, float]] = {}
        self._sync_cache: dict[tuple, tuple[float, float]] = {}  # (fixed s, s per byte)
        self._plan_groups: dict[tuple[Placement, int], tuple] = {}  # to_plan's per-placement part
        self.repartition_cache: dict[tuple, tuple[float, dict, dict]] = {}  # the estimate's transfers

    @cached_property
    def fingerprints(self) -> tuple[str, str]:
        """(graph, cluster) fingerprints, hashed once: every Plan the search emits carries them."""
        return self.graph.fingerprint(), self.cluster.fingerprint()

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    # -- per-device speed ----------------------------------------------------------------
    @cached_property
    def device_time_per_sample_s(self) -> np.ndarray:
        """Whole-graph forward + backward time per sample on each device (at the full batch)."""
        per_class = (self.fwd[:, :, 1] + self.bwd[:, :, 1]).sum(axis=0) + (self.fwd[:, :, 0] + self.bwd[:, :, 0]).sum(
            axis=0
        ) / self.batch_size
        return per_class[self.dev_class]

    @cached_property
    def speed_order(self) -> list[int]:
        """Devices from fastest to slowest (ties by index, so it is deterministic)."""
        t = self.device_time_per_sample_s
        return sorted(range(self.n_devices), key=lambda i: (t[i], i))

    # -- communication look-ups (cached) ---------------------------------------------------
    def pair_cost(self, src: int, dst: int) -> tuple[float, float]:
        """(latency_s, seconds per byte) between two devices, from the cost model; once per
        pair of tiers (devices of a tier are alike, and so are their nodes' links)."""
        key = (self.tier_of[src], self.tier_of[dst], self.node_idx[src] == self.node_idx[dst], src == dst)
        hit = self._pair_cache.get(key)
        if hit is None:
            a, b = self.device_names[src], self.device_names[dst]
            t1 = self.costs.transfer_time_s(1e6, a, b)
            t2 = self.costs.transfer_time_s(2e6, a, b)
            per_byte = max(0.0, (t2 - t1) / 1e6)
            hit = (max(0.0, t1 - 1e6 * per_byte), per_byte)
            self._pair_cache[key] = hit
        return hit

    def sync_time_bytes_s(self, p: Placement, nbytes: float) -> float:
        """Gradient synchronisation of `nbytes` over p's replicas. Collectives are alpha–beta
        in the buffer size, so two cost-model calls per (devices, method) give the line."""
        if len(p.devices) < 2 or nbytes <= 0:
            return 0.0
        key = (p.devices, p.sync, p.ps)
        hit = self._sync_cache.get(key)
        if hit is None:
            names = [self.device_names[i] for i in p.devices]

            def t(b: float) -> float:
                if p.sync == SyncMethod.PS:
                    assert p.ps is not None  # a parameter-server placement names its server
                    return self.costs.ps_sync_time_s(b, names, self.device_names[p.ps])
                return self.costs.collective_time_s("allreduce", b, names, p.sync)

            t1, t2 = t(1e7), t(2e7)
            per_byte = max(0.0, (t2 - t1) / 1e7)
            hit = (max(0.0, t1 - 1e7 * per_byte), per_byte)
            self._sync_cache[key] = hit
        return hit[0] + hit[1] * nbytes

    def sync_time_s(self, g: int, p: Placement) -> float:
        return self.sync_time_bytes_s(p, float(self.grad_bytes[g]))

    # -- turning a strategy into the artifact ------------------------------------------------
    def integer_placement(self, p: Placement, microbatch_samples: int) -> Placement:
        """Shares as whole samples of a micro-batch; replicas left with none are dropped."""
        counts = split_samples(microbatch_samples, list(p.shares))
        keep = [i for i, k in enumerate(counts) if k > 0]
        devs = tuple(p.devices[i] for i in keep)
        shares = tuple(counts[i] / microbatch_samples for i in keep)
        sync, ps = p.sync, p.ps
        if len(devs) == 1:
            sync, ps = SyncMethod.NONE, None
        elif sync == SyncMethod.NONE:
            sync = SyncMethod.RING
        if sync == SyncMethod.PS and ps is None:
            ps = devs[0]
        shard = p.shard if len(devs) > 1 else 0
        tp = tuple(p.tp[i] for i in keep) if p.tp else ()
        shards: tuple[float, ...] = ()
        if shard:  # the replicas kept keep their fractions, renormalised
            kept = [p.shards[i] for i in keep]
            total = sum(kept)
            shards = tuple(f / total for f in kept) if total > 0 else tuple([1.0 / len(kept)] * len(kept))
            sync, ps = SyncMethod.RING, None
        # the replicas kept keep their counts, at most their samples
        pieces = tuple(min(p.accumulate[i], counts[i]) for i in keep) if p.accumulate else ()
        pieces = pieces if any(k > 1 for k in pieces) else ()
        return Placement(
            devs, shares, sync, ps if sync == SyncMethod.PS else None, p.recompute, shard, shards, pieces, tp
        )

    def finalize(self, s: Strategy) -> Strategy:
        m = s.microbatches if self.batch_size % s.microbatches == 0 else 1
        mb = self.batch_size // m
        return replace(s, placements=tuple(self.integer_placement(p, mb) for p in s.placements), microbatches=m)

    def _group_fields(self, p: Placement, microbatch_samples: int) -> tuple:
        """(replicas, sync, ps device, recompute, shard stage) of a placement in the Plan, made once per
        placement: neighbouring strategies share all but a few of them."""
        key = (p, microbatch_samples)
        hit = self._plan_groups.get(key)
        if hit is None:
            q = self.integer_placement(p, microbatch_samples)
            replicas = tuple(
                Replica(
                    device=self.device_names[d],
                    share=sh,
                    shard=q.shards[i] if q.shard else None,
                    accumulate=q.accumulate[i] if q.accumulate else 1,
                    tp_devices=tuple(self.device_names[m] for m in q.tp[i]) if q.tp else (),
                )
                for i, (d, sh) in enumerate(zip(q.devices, q.shares))
            )
            ps_device = self.device_names[q.ps] if q.sync == SyncMethod.PS and q.ps is not None else None
            hit = (replicas, q.sync, ps_device, q.recompute, q.shard)
            if len(self._plan_groups) > 20_000:
                self._plan_groups.clear()
            self._plan_groups[key] = hit
        return hit

    def to_plan(self, s: Strategy, strategy_name: str, notes: Sequence[str] = ()) -> Plan:
        m = s.microbatches if self.batch_size % s.microbatches == 0 else 1
        groups = []
        for g, (names, p) in enumerate(zip(self.groups, s.placements)):
            replicas, sync, ps_device, recompute, shard_stage = self._group_fields(p, self.batch_size // m)
            groups.append(
                Group(
                    name=f"g{g}",
                    nodes=tuple(names),
                    replicas=replicas,
                    sync=sync,
                    ps_device=ps_device,
                    recompute=recompute,
                    shard_stage=shard_stage,
                )
            )
        spec = self.model_spec or ModelSpec(
            name=self.graph.model, batch_size=self.batch_size, seq_len=self.graph.seq_len
        )
        return without_stray_counts(
            Plan(
                strategy=strategy_name,
                model=spec,
                precision=Precision(self.precision),
                optimizer=self.optimizer,
                groups=tuple(groups),
                num_microbatches=m,
                schedule=s.schedule,
                bucket_bytes=s.bucket_bytes,
                notes=tuple(notes),
                graph_fingerprint=self.fingerprints[0],
                cluster_fingerprint=self.fingerprints[1],
            )
        )
