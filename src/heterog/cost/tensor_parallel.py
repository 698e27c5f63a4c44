"""Megatron-style tensor parallelism in the cost model: what one rank of a tensor-parallel
group computes, holds and communicates.

Megatron-LM splits a transformer block over t devices (Shoeybi et al., "Megatron-LM", 2019,
§3 and Fig. 3): the first linear of the attention (QKV) and of the MLP is column-parallel
(its output features divided), the attention heads and the MLP's hidden units between are
divided, and the second linear is row-parallel (its input features divided), so each half of
the block needs one all-reduce of its output activations in forward (operator g) and one of
the gradient of its input in backward (operator f): two and two per block. The vocabulary
embedding and the output head it is tied to are split by vocabulary rows (Megatron's
VocabParallelEmbedding: one all-reduce of the embedding output in forward;
parallel_lm_logits: one of its input's gradient in backward), and the cross-entropy over the
split logits all-reduces three numbers per token (vocab_parallel_cross_entropy: the maximum,
the target logit, the sum of exponentials; fp32). Everything else — layer norms, position
embeddings, the dropouts and residual adds outside the split region — is replicated.

The model is a graph of one rank (`split_graph`): each split node keeps its name with its
FLOPs, traffic, parameters and saved activations divided as above, so the roofline prices the
smaller GEMMs at the efficiency of their own size (cost/roofline.py), not at 1/t of the whole
time. What stays full width: a column-parallel linear reads its whole input and saves it for
backward, a row-parallel linear writes its whole output — the activation memory of
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
§4.2.2: sbh(10 + 24/t + 5as/(ht)) per layer, the 10 (norm inputs, the two column-parallel
inputs, the two dropout masks outside the region) not divided.

`TensorParallelCostModel` is the analytic cost model on that graph with the group's
collectives added. The plan names one device per tensor-parallel group (its first rank); the
model knows each such device's group, times the per-block all-reduces over the group's own
links (ring, alpha-beta: cost/comm.py) and adds them to the node they follow (Megatron v1 runs
them on the compute stream, not overlapped), and times the plan's collectives and transfers
between groups as the t sibling rings (or sends) that run at once, sharing whatever links they
cross (a node's NIC, for a data-parallel ring across nodes).

Limits: one degree per node (`node_degrees`: pipeline stages may differ); sequence
parallelism (reduce-scatter + all-gather instead of each all-reduce) is not modelled; only
ring collectives between groups; a row linear's bias (replicated in Megatron) is counted as
split (1/in of its parameters); with recompute, the forward's all-reduces are not counted
again in backward (Megatron's activation checkpointing repeats them); an untied embedding and
head stay replicated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from heterog.cost import comm
from heterog.cost.analytic import AnalyticCostModel
from heterog.errors import GraphError, PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.affine import Affine
from heterog.ir.kinds import HALF_PRECISIONS, Phase, SyncMethod
from heterog.ir.opgraph import OpGraph, OpNode

DEGREES = (1, 2, 4, 8)
FP32_BYTES = 4.0  # the capture's sizes are of fp32 tensors (OpGraph.dtype "float32")
LOSS_ALLREDUCES = 3  # vocab_parallel_cross_entropy: max, target logit, sum of exponentials


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRegion:
    """One half of a transformer block as Megatron splits it: the replicated norm whose
    output it reads, the column-parallel linears reading that output, the nodes between
    (heads or hidden units divided) and the row-parallel linear that ends it."""

    norm: str
    column: tuple[str, ...]
    inner: tuple[str, ...]
    row: str


@dataclass(frozen=True, kw_only=True, slots=True)
class VocabSplit:
    """The vocabulary-parallel embedding, the output head tied to it, and the loss after it."""

    embedding: str
    head: str
    losses: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelLayout:
    regions: tuple[SplitRegion, ...]
    vocab: VocabSplit | None


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupCollective:
    """An all-reduce within a tensor-parallel group that follows `node`'s `phase`: its bytes
    per rank are `elements` (affine in the batch) × `element_bytes`."""

    node: str
    phase: Phase
    elements: Affine
    element_bytes: float


def _region_from(graph: OpGraph, norm: OpNode) -> SplitRegion | None:
    """The region that `norm`'s output opens, or None when the nodes after it do not form
    one: the matmuls reading the norm's output (the column-parallel linears; its other
    readers, a residual path, stay outside), then a closed sub-graph ending in the first
    matmul that is not one of them and writes the width the columns read."""
    succ = graph.successors
    column = tuple(s for s in succ[norm.name] if graph.node(s).kind == "matmul")
    if not column:
        return None
    width = _edge_bytes(graph, norm.name, column[0])
    inside: set[str] = set(column)
    frontier, row = list(column), None
    while frontier:
        name = frontier.pop()
        for s in succ[name]:
            node = graph.node(s)
            if node.kind == "matmul" and s not in column and node.output_bytes.per_sample == width:
                if row not in (None, s):
                    return None  # two ends: not one region
                row = s
            elif s not in inside:
                if node.kind == "norm" or not succ[s]:
                    return None  # past the block without a row-parallel linear
                inside.add(s)
                frontier.append(s)
    if row is None:
        return None
    inner = tuple(n.name for n in graph.nodes if n.name in inside and n.name not in column)
    return SplitRegion(norm=norm.name, column=tuple(column), inner=inner, row=row)


def _vocab_split(graph: OpGraph) -> VocabSplit | None:
    """The embedding whose weight an output head (a matmul) reads too, and the loss nodes
    after the head: Megatron splits both by vocabulary rows."""
    for tie in graph.ties:
        kinds = {graph.node(n).kind: n for n in tie.nodes}
        if "embedding" in kinds and "matmul" in kinds:
            head = kinds["matmul"]
            losses = tuple(n.name for n in graph.nodes if n.kind == "loss")
            return VocabSplit(embedding=kinds["embedding"], head=head, losses=losses)
    return None


def megatron_layout(graph: OpGraph, *, vocab_parallel: bool = True) -> TensorParallelLayout:
    """The split regions of `graph`'s transformer blocks (two per block) and, with
    `vocab_parallel`, its tied embedding and head. A graph with no region is refused."""
    regions = tuple(r for n in graph.nodes if n.kind == "norm" and (r := _region_from(graph, n)) is not None)
    if not regions:
        raise GraphError(
            f"{graph.model}: no transformer block follows Megatron's pattern (a norm, column-parallel "
            "linears reading it, a row-parallel linear writing its width), so tensor parallelism cannot split it."
        )
    return TensorParallelLayout(regions=regions, vocab=_vocab_split(graph) if vocab_parallel else None)


def _keep_full(a: Affine, full_per_sample: float, degree: int) -> Affine:
    """`a` divided by `degree` except `full_per_sample` of it, which every rank moves whole."""
    keep = min(full_per_sample, a.per_sample)
    return Affine(a.fixed / degree, keep + (a.per_sample - keep) / degree)


def _divided(node: OpNode, degree: int, **kept: Affine) -> OpNode:
    """`node` with FLOPs, traffic, saved and produced bytes and parameters divided by
    `degree`, except the fields given in `kept`."""
    d = 1.0 / degree
    fields: dict[str, Any] = {
        "fwd_flops": node.fwd_flops.scaled(d),
        "bwd_flops": node.bwd_flops.scaled(d),
        "fwd_bytes": node.fwd_bytes.scaled(d),
        "bwd_bytes": node.bwd_bytes.scaled(d),
        "saved_bytes": node.saved_bytes.scaled(d),
        "output_bytes": node.output_bytes.scaled(d),
        "workspace_bytes": node.workspace_bytes.scaled(d),
    }
    fields.update(kept)
    return replace(
        node,
        **fields,
        param_count=round(node.param_count * d),
        param_bytes=round(node.param_bytes * d),
    )


def _edge_bytes(graph: OpGraph, src: str, dst: str) -> float:
    """Per-sample bytes on the edge src → dst (0 without one)."""
    return sum(e.bytes.per_sample for e in graph.edges if e.src == src and e.dst == dst)


def _in_bytes(graph: OpGraph, node: str) -> float:
    """Per-sample bytes of what flows into `node` along the graph's edges."""
    return sum(e.bytes.per_sample for e in graph.edges if e.dst == node)


def _split_linear(n: OpNode, full_per_sample: float, degree: int, **kept: Affine) -> OpNode:
    """A split linear that moves `full_per_sample` bytes whole: once in forward, twice in
    backward; its largest transient stays whole-width."""
    return _divided(
        n,
        degree,
        fwd_bytes=_keep_full(n.fwd_bytes, full_per_sample, degree),
        bwd_bytes=_keep_full(n.bwd_bytes, 2 * full_per_sample, degree),
        workspace_bytes=n.workspace_bytes,
        **kept,
    )


def _column_parallel(graph: OpGraph, name: str, degree: int) -> OpNode:
    """A linear split by output features: it reads (and saves for backward, Korthikanti et
    al. 2022 §4.2.2) its whole input, and writes its input's whole gradient."""
    n = graph.node(name)
    return _split_linear(n, _in_bytes(graph, name), degree, saved_bytes=n.saved_bytes)


def _row_parallel(n: OpNode, degree: int) -> OpNode:
    """A linear split by input features: each rank writes a whole-width partial output (the
    all-reduce sums them) and reads its gradient whole in backward."""
    return _split_linear(n, n.output_bytes.per_sample, degree, output_bytes=n.output_bytes)


def split_graph(graph: OpGraph, layout: TensorParallelLayout, degree: int) -> OpGraph:
    """The graph one rank of a `degree`-way tensor-parallel group runs (same node names)."""
    if degree not in DEGREES:
        raise PlanError(f"tensor-parallel degree {degree} is not supported; use one of {DEGREES}.")
    if degree == 1:
        return graph
    if graph.dtype != "float32":
        raise GraphError(f"{graph.model}: the capture is in {graph.dtype}; tensor parallelism needs an fp32 capture.")
    new: dict[str, OpNode] = {}
    split_out: set[str] = set()  # nodes whose outputs are divided (their out-edges too)
    for r in layout.regions:
        for c in r.column:
            new[c] = _column_parallel(graph, c, degree)
        for i in r.inner:
            new[i] = _divided(graph.node(i), degree)
        new[r.row] = _row_parallel(graph.node(r.row), degree)
        split_out.update(r.column + r.inner)
    v = layout.vocab
    if v is not None:
        e = graph.node(v.embedding)
        new[v.embedding] = replace(
            e, param_count=round(e.param_count / degree), param_bytes=round(e.param_bytes / degree)
        )
        new[v.head] = _column_parallel(graph, v.head, degree)  # split by vocabulary rows
        for loss in v.losses:
            new[loss] = _divided(graph.node(loss), degree, output_bytes=graph.node(loss).output_bytes)
        split_out.add(v.head)
    nodes = tuple(new.get(n.name, n) for n in graph.nodes)
    edges = tuple(replace(e, bytes=e.bytes.scaled(1.0 / degree)) if e.src in split_out else e for e in graph.edges)
    tied = {v.embedding} if v is not None else set()
    ties = tuple(
        replace(t, param_bytes=round(t.param_bytes / degree)) if tied & set(t.nodes) else t for t in graph.ties
    )
    return _with_nodes(graph, nodes, edges, ties, degree)


def _with_nodes(graph: OpGraph, nodes: tuple, edges: tuple, ties: tuple, degree: int) -> OpGraph:
    """`graph` with one rank's nodes, edges and ties, its parameters counted again."""
    return replace(
        graph,
        nodes=nodes,
        edges=edges,
        ties=ties,
        num_parameters=sum(n.param_count for n in nodes),
        meta={**graph.meta, "tensor_parallel_degree": degree},
    )


def split_graph_by_node(graph: OpGraph, layout: TensorParallelLayout, degrees: Mapping[str, int]) -> OpGraph:
    """The graph of one rank where node n is split `degrees[n]` ways (pipeline stages of
    different degrees): each node and its out-edges as `split_graph` at its own degree."""
    found = sorted({degrees.get(n.name, 1) for n in graph.nodes})
    if len(found) == 1:
        return split_graph(graph, layout, found[0])
    v = layout.vocab
    if v is not None and degrees.get(v.embedding, 1) != degrees.get(v.head, 1):
        raise PlanError(
            f"{graph.model}: the embedding {v.embedding!r} (split {degrees.get(v.embedding, 1)} ways) and the "
            f"output head tied to it {v.head!r} (split {degrees.get(v.head, 1)} ways) must share a "
            f"tensor-parallel degree: the tied weight is split by vocabulary rows alike. Give their stages "
            f"the same degree."
        )
    by = {d: split_graph(graph, layout, d) for d in found}  # nodes and edges in graph's order
    nodes = tuple(by[degrees.get(n.name, 1)].nodes[i] for i, n in enumerate(graph.nodes))
    edges = tuple(by[degrees.get(e.src, 1)].edges[i] for i, e in enumerate(graph.edges))
    ties = by[degrees.get(v.embedding, 1)].ties if v is not None else graph.ties
    return _with_nodes(graph, nodes, edges, ties, found[-1])


def group_collectives(graph: OpGraph, layout: TensorParallelLayout, precision: str) -> tuple[GroupCollective, ...]:
    """Every all-reduce a tensor-parallel group runs per micro-batch, on the unsplit graph's
    sizes: per region one of the row linear's output after its forward and one of the norm's
    output gradient after the column linears' backward; with a vocabulary split, the
    embedding's output (forward), the head's input gradient (backward) and the loss's three
    per-token statistics (forward, fp32)."""
    act_bytes = 2.0 if precision in HALF_PRECISIONS else FP32_BYTES
    out: list[GroupCollective] = []
    for r in layout.regions:
        row = graph.node(r.row).output_bytes.scaled(1.0 / FP32_BYTES)
        grad = Affine(0.0, _edge_bytes(graph, r.norm, r.column[0]) / FP32_BYTES)
        out.append(GroupCollective(node=r.row, phase=Phase.FORWARD, elements=row, element_bytes=act_bytes))
        # backward runs the region in reverse: the first column linear's backward ends it
        out.append(GroupCollective(node=r.column[0], phase=Phase.BACKWARD, elements=grad, element_bytes=act_bytes))
    v = layout.vocab
    if v is not None:
        emb = graph.node(v.embedding).output_bytes.scaled(1.0 / FP32_BYTES)
        head_in = Affine(0.0, _in_bytes(graph, v.head) / FP32_BYTES)
        out.append(GroupCollective(node=v.embedding, phase=Phase.FORWARD, elements=emb, element_bytes=act_bytes))
        out.append(GroupCollective(node=v.head, phase=Phase.BACKWARD, elements=head_in, element_bytes=act_bytes))
        if v.losses and graph.seq_len:
            tokens = Affine(0.0, float(graph.seq_len))
            out += [
                GroupCollective(node=v.losses[0], phase=Phase.FORWARD, elements=tokens, element_bytes=FP32_BYTES)
                for _ in range(LOSS_ALLREDUCES)
            ]
    return tuple(out)


def sibling_ring_time_s(cluster: Cluster, op: str, nbytes: float, rings: Sequence[Sequence[str]]) -> float:
    """Ring collectives of `nbytes` per member over every ring in `rings` at once (one ring
    per tensor-parallel rank): each step moves nbytes/n along every edge of every ring and
    lasts as long as its most loaded link (cost/comm.py step_time_s)."""
    n = len(rings[0])
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = {"allreduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}.get(op)
    if steps is None:
        raise PlanError(f"collective {op!r} between tensor-parallel groups is not modelled; use a ring all-reduce.")
    chunk = nbytes / n
    step = comm.step_time_s(cluster, ((r[i], r[(i + 1) % n], chunk) for r in rings for i in range(n)))
    return steps * step


class TensorParallelCostModel(AnalyticCostModel):
    """The analytic cost model of one tensor-parallel rank (module docstring). `groups` maps
    each device a plan places work on to the devices of its tensor-parallel group, itself
    first, in rank order; every group has `degree` devices. With `node_degrees` (pipeline
    stages of different degrees), node n is split node_degrees[n] ways (1 where absent) and
    a group has as many devices as the degree of the nodes placed on it."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        degree: int,
        groups: Mapping[str, Sequence[str]],
        vocab_parallel: bool = True,
        precision: str = "fp32",
        optimizer: str = "sgd",
        recompute: bool = False,
        node_degrees: Mapping[str, int] | None = None,
    ):
        layout = megatron_layout(graph, vocab_parallel=vocab_parallel)
        split = (
            split_graph(graph, layout, degree)
            if node_degrees is None
            else split_graph_by_node(graph, layout, node_degrees)
        )
        super().__init__(split, cluster, precision=precision, optimizer=optimizer, recompute=recompute)
        sizes = {degree} if node_degrees is None else {*node_degrees.values(), 1}
        for device, members in groups.items():
            if len(members) not in sizes or members[0] != device:
                raise PlanError(
                    f"tensor-parallel group of {device!r} is {list(members)}; it must list "
                    f"{' or '.join(map(str, sorted(sizes)))} devices, {device!r} first."
                )
            for m in members:
                cluster.device(m)  # an unknown device is a ClusterError naming it
        self.degree = degree
        # a rank's times depend on its group's links, not only its type: no class sharing
        # (lower/context.py ClusterInfo)
        self.own_class_devices = frozenset(groups)
        self.layout = layout
        self.groups = {d: tuple(m) for d, m in groups.items()}
        self.collectives = group_collectives(graph, layout, precision)
        self._by_node: dict[tuple[int, Phase], list[GroupCollective]] = {}
        for c in self.collectives:
            self._by_node.setdefault((self.graph.index[c.node], c.phase), []).append(c)

    def group_of(self, device: str) -> tuple[str, ...]:
        members = self.groups.get(device)
        if members is None:
            raise PlanError(
                f"device {device!r} has no tensor-parallel group; the plan may place work only on "
                f"{sorted(self.groups)} (each group's first device)."
            )
        return members

    def _group_time_s(self, i: int, device: str, batch: float, phase: Phase) -> float:
        """The tensor-parallel all-reduces that follow node `i`'s `phase` at `batch`."""
        found = self._by_node.get((i, phase))
        if not found or batch <= 0:
            return 0.0
        members = self.group_of(device)
        return sum(
            comm.cached_collective_time_s(
                self._comm_cache, self.cluster, "allreduce", c.elements.at(batch) * c.element_bytes, members
            )
            for c in found
        )

    def group_collectives_time_s(
        self, nodes: Sequence[str], device: str, batch: float, phases: Sequence[Phase] = (Phase.FORWARD, Phase.BACKWARD)
    ) -> float:
        """The tensor-parallel all-reduces of `nodes` at `batch` in `phases` (both by default):
        the part of their compute time that is communication within `device`'s group."""
        index = self.graph.index
        return sum(self._group_time_s(index[n], device, batch, phase) for n in nodes for phase in phases)

    def compute_time_s(self, node: str, device: str, batch: float, phase: Phase) -> float:
        return super().compute_time_s(node, device, batch, phase) + self._group_time_s(
            self.graph.index[node], device, batch, phase
        )

    def node_times_s(self, nodes: Sequence[str], device: str, batch: float, phase: Phase) -> np.ndarray:
        times = super().node_times_s(nodes, device, batch, phase)
        index = self.graph.index
        return times + np.array([self._group_time_s(index[n], device, batch, phase) for n in nodes])

    def group_time_s(self, nodes: Sequence[str], device: str, batch: float, phase: Phase) -> float:
        return float(self.node_times_s(nodes, device, batch, phase).sum()) if nodes and batch > 0 else 0.0

    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        """Each rank sends its whole copy to its counterpart in the other group, all at once."""
        if src == dst or nbytes <= 0:
            return 0.0
        a, b = self.group_of(src), self.group_of(dst)
        if len(a) == len(b):
            pairs = list(zip(a, b, strict=True))
        else:  # stages of different degrees: every rank of the larger set gets a whole copy
            pairs = [(a[k % len(a)], b[k % len(b)]) for k in range(max(len(a), len(b)))]
        return comm.step_time_s(self.cluster, ((s, d, nbytes) for s, d in pairs))

    def collective_time_s(self, op: str, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING) -> float:
        if method != SyncMethod.RING:
            raise PlanError(
                f"sync method {method!r} between tensor-parallel groups is not modelled; use {SyncMethod.RING!r}."
            )
        if nbytes <= 0 or len(set(devices)) <= 1:
            return 0.0
        ring = comm.ring_order(self.cluster, devices)
        sets = [self.group_of(d) for d in ring]
        # one ring per tensor rank; between sets of different sizes (a tie across stages of
        # different degrees) a smaller set's ranks join several rings
        rings = [[m[k % len(m)] for m in sets] for k in range(max(map(len, sets)))]
        fixed, per_byte = comm.affine_in_bytes(
            self._comm_cache,
            ("tp-siblings", op, tuple(ring)),
            lambda b: sibling_ring_time_s(self.cluster, op, b, rings),
        )
        return fixed + per_byte * nbytes

    def ps_sync_time_s(self, nbytes: float, devices: Sequence[str], server: str) -> float:
        raise PlanError("a parameter server between tensor-parallel groups is not modelled; sync them by 'ring'.")


__all__ = [
    "GroupCollective",
    "SplitRegion",
    "TensorParallelCostModel",
    "TensorParallelLayout",
    "VocabSplit",
    "group_collectives",
    "megatron_layout",
    "split_graph",
    "split_graph_by_node",
]
