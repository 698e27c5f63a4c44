"""OpGraph: the model's computation for one training iteration, as a DAG of placeable nodes.

A node is a leaf-module call (e.g. ``layer3.2.conv1``) or a run of loose aten ops executed
directly by a container module (a residual add, attention math). Every cost is an Affine in
the batch so one capture serves every batch share. Nodes are stored in execution order,
which is a topological order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Literal

from heterog.errors import ArtifactError, GraphError
from heterog.ir.affine import ZERO, Affine
from heterog.jsonio import Artifact

SCHEMA_VERSION = 1
KIND = "heterog.OpGraph"

# What an op spends its time on; the cost model picks efficiency curves by kind.
OpKind = Literal[
    "matmul", "conv", "attention", "norm", "elementwise", "pool", "embedding", "reduction", "loss", "memory", "other"
]
OP_KINDS: tuple[str, ...] = OpKind.__args__  # type: ignore[attr-defined]

_AFFINE_FIELDS = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes", "output_bytes", "workspace_bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpNode:
    name: str  # unique; the leaf module path, '#k' appended on repeat calls
    module_path: str  # owning module ('' = the root model)
    module_type: str  # class of the owning module, e.g. 'Conv2d'
    kind: str  # one of OP_KINDS
    fwd_flops: Affine = ZERO
    bwd_flops: Affine = ZERO
    fwd_bytes: Affine = ZERO  # memory traffic: bytes read + written by its kernels
    bwd_bytes: Affine = ZERO
    saved_bytes: Affine = ZERO  # activations autograd keeps for backward (de-duplicated)
    output_bytes: Affine = ZERO  # bytes of the outputs other nodes consume
    workspace_bytes: Affine = ZERO  # largest transient tensor while it runs
    param_names: tuple[str, ...] = ()  # parameters this node owns (a shared one: first user; see Tie)
    param_count: int = 0
    param_bytes: int = 0
    batch_splittable: bool = True  # False: its work does not divide along the batch
    fwd_kernels: int = 0  # aten ops launched in forward / backward (host overhead)
    bwd_kernels: int = 0
    tensor_core_flops_fraction: float = 0.0  # share of FLOPs in matmul/conv/attention kernels

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Affine):
                value = value.to_json()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @staticmethod
    def from_json(doc: dict[str, Any], where: str) -> OpNode:
        if not isinstance(doc, dict):
            raise GraphError(f"{where}: a node must be a JSON object, found {type(doc).__name__}.")
        known = {f.name for f in fields(OpNode)}
        unknown = set(doc) - known
        if unknown:
            raise GraphError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}.")
        for required in ("name", "module_path", "module_type", "kind"):
            if required not in doc:
                raise GraphError(f"{where}: missing field {required!r}.")
        kwargs: dict[str, Any] = {}
        for key, value in doc.items():
            if key in _AFFINE_FIELDS:
                try:
                    value = Affine.from_json(value)
                except ValueError as e:
                    raise GraphError(f"{where} field {key!r}: {e}.") from None
            elif key == "param_names":
                value = tuple(value)
            kwargs[key] = value
        return OpNode(**kwargs)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpEdge:
    src: str
    dst: str
    bytes: Affine  # size of the tensors flowing src → dst, per batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Tie:
    """One parameter read by several nodes: weights tied between modules (an embedding and
    the output projection) or a module called more than once. `nodes[0]` owns it (lists it
    in param_names and counts its bytes); a plan that puts the others in groups on other
    devices gives each of those devices a copy whose gradient is summed across the copies
    every step (`tie_holders`)."""

    param: str
    nodes: tuple[str, ...]
    param_bytes: int


@dataclass(frozen=True, kw_only=True)
class OpGraph(Artifact, kind=KIND, version=SCHEMA_VERSION):
    model: str
    batch_size: int  # the reference batch the capture ran at
    seq_len: int | None = None
    dtype: str = "float32"
    nodes: tuple[OpNode, ...]
    edges: tuple[OpEdge, ...]
    input_bytes: Affine = ZERO  # the example batch itself
    num_parameters: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # provenance: capture time, torch version
    ties: tuple[Tie, ...] = ()  # parameters read by more than one node

    # -- look-ups ------------------------------------------------------------------------
    @cached_property
    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def node(self, name: str) -> OpNode:
        try:
            return self.nodes[self.index[name]]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph of {self.model}.") from None

    @cached_property
    def successors(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for e in self.edges:
            out[e.src].append(e.dst)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def predecessors(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for e in self.edges:
            out[e.dst].append(e.src)
        return {k: tuple(v) for k, v in out.items()}

    # -- totals at a batch size -------------------------------------------------------------
    def forward_flops(self, batch: float | None = None) -> float:
        b = self.batch_size if batch is None else batch
        return sum(n.fwd_flops.at(b) for n in self.nodes)

    def backward_flops(self, batch: float | None = None) -> float:
        b = self.batch_size if batch is None else batch
        return sum(n.bwd_flops.at(b) for n in self.nodes)

    def saved_activation_bytes(self, batch: float | None = None) -> float:
        b = self.batch_size if batch is None else batch
        return sum(n.saved_bytes.at(b) for n in self.nodes)

    def param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)

    def tie_holders(self, group_of_node: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Tied parameter → the groups that hold a copy of it (those of its nodes), for a
        partition of the nodes into groups; only parameters held by two or more groups. Each
        holder beyond the owner's group stores the parameter, its gradient and its optimizer
        state, and the holders' devices all-reduce its gradient once per step."""
        out = {}
        for t in self.ties:
            groups = tuple(sorted({group_of_node[n] for n in t.nodes}))
            if len(groups) > 1:
                out[t.param] = groups
        return out

    def fingerprint(self) -> str:
        """Identifies the model structure and costs; a Plan records it to detect mismatches."""
        body = json.dumps(self.to_dict(include_meta=False), sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> OpGraph:
        """Check structure and values; raise GraphError naming the offending node or edge."""
        if self.batch_size <= 0:
            raise GraphError(f"graph of {self.model}: batch_size must be positive, found {self.batch_size}.")
        seen: set[str] = set()
        for i, n in enumerate(self.nodes):
            where = f"node {i} ({n.name!r})"
            if not n.name:
                raise GraphError(f"node {i}: empty name; every node needs a unique name.")
            if n.name in seen:
                raise GraphError(f"{where}: duplicate node name; names must be unique.")
            seen.add(n.name)
            if n.kind not in OP_KINDS:
                raise GraphError(f"{where}: unknown kind {n.kind!r}; use one of {', '.join(OP_KINDS)}.")
            for fname in _AFFINE_FIELDS:
                a: Affine = getattr(n, fname)
                for b in (0.0, 1.0, float(self.batch_size)):
                    if a.at(b) < -1e-6 * max(1.0, abs(a.fixed)):
                        raise GraphError(
                            f"{where}: {fname} is negative at batch {b:g} ({a.at(b):g}); sizes and FLOPs must be ≥ 0."
                        )
            for fname in ("param_count", "param_bytes", "fwd_kernels", "bwd_kernels"):
                if getattr(n, fname) < 0:
                    raise GraphError(f"{where}: {fname} is negative ({getattr(n, fname)}).")
            if not 0.0 <= n.tensor_core_flops_fraction <= 1.0:
                raise GraphError(f"{where}: tensor_core_flops_fraction must lie in [0, 1].")
        for j, e in enumerate(self.edges):
            for end in (e.src, e.dst):
                if end not in seen:
                    raise GraphError(
                        f"edge {j} ({e.src!r} → {e.dst!r}) refers to node {end!r}, which does not "
                        f"exist: a dangling edge. Remove it or add the node."
                    )
            if e.src == e.dst:
                raise GraphError(f"edge {j}: self-loop on {e.src!r}; a node cannot feed itself.")
            if e.bytes.at(self.batch_size) < 0:
                raise GraphError(f"edge {j} ({e.src!r} → {e.dst!r}): negative bytes.")
        for j, t in enumerate(self.ties):
            missing = [n for n in t.nodes if n not in seen]
            if missing or len(t.nodes) < 2:
                raise GraphError(
                    f"tie {j} of parameter {t.param!r}: needs two or more existing nodes, "
                    f"found {list(t.nodes)}"
                    + (f" (no node {missing[0]!r})" if missing else "")
                    + "; fix or drop the tie."
                )
            owner = self.nodes[self.index[t.nodes[0]]]
            if t.param not in owner.param_names:
                raise GraphError(
                    f"tie {j}: its first node {owner.name!r} must own parameter {t.param!r} "
                    f"(list it in param_names), since the tie's first node holds it."
                )
        cycle = self._find_cycle()
        if cycle:
            path = " → ".join(cycle)
            raise GraphError(
                f"cycle {path}: the simulator could never start {cycle[1]!r}, because it "
                f"waits for itself. An OpGraph must be acyclic."
            )
        return self

    def _find_cycle(self) -> list[str] | None:
        succ: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for e in self.edges:
            succ[e.src].append(e.dst)
        state: dict[str, int] = {}
        for root in succ:
            if root in state:
                continue
            stack = [(root, iter(succ[root]))]
            state[root] = 1
            path = [root]
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    stack.pop()
                    path.pop()
                elif state.get(nxt) == 1:
                    return path[path.index(nxt) :] + [nxt]
                elif nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(succ[nxt])))
                    path.append(nxt)
        return None

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self, include_meta: bool = True) -> dict[str, Any]:
        body = {
            "model": self.model,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "num_parameters": self.num_parameters,
            "input_bytes": self.input_bytes.to_json(),
            "nodes": [n.to_json() for n in self.nodes],
            "edges": [[e.src, e.dst, e.bytes.to_json()] for e in self.edges],
        }
        if self.ties:  # absent when there are none: graphs without ties keep their fingerprint
            body["ties"] = [[t.param, list(t.nodes), t.param_bytes] for t in self.ties]
        if include_meta:
            body["meta"] = self.meta
        return body

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "<graph>") -> OpGraph:
        try:
            raw_nodes = doc["nodes"]
            raw_edges = doc["edges"]
            nodes = tuple(OpNode.from_json(d, f"{source}: node {i}") for i, d in enumerate(raw_nodes))
            edges = []
            for j, e in enumerate(raw_edges):
                if not (isinstance(e, list) and len(e) == 3):
                    raise GraphError(f"{source}: edge {j} must be [src, dst, [fixed, per_sample]], found {e!r}.")
                try:
                    edges.append(OpEdge(src=e[0], dst=e[1], bytes=Affine.from_json(e[2])))
                except ValueError as err:
                    raise GraphError(f"{source}: edge {j} bytes: {err}.") from None
            ties = []
            for j, t in enumerate(doc.get("ties", [])):  # optional: graphs saved before ties load
                if not (isinstance(t, list) and len(t) == 3 and isinstance(t[1], list)):
                    raise GraphError(f"{source}: tie {j} must be [param, [nodes...], param_bytes], found {t!r}.")
                ties.append(Tie(param=t[0], nodes=tuple(t[1]), param_bytes=int(t[2])))
            graph = OpGraph(
                model=doc["model"],
                batch_size=doc["batch_size"],
                seq_len=doc.get("seq_len"),
                dtype=doc.get("dtype", "float32"),
                nodes=nodes,
                edges=tuple(edges),
                input_bytes=Affine.from_json(doc.get("input_bytes", [0, 0])),
                num_parameters=doc.get("num_parameters", 0),
                meta=doc.get("meta", {}),
                ties=tuple(ties),
            )
        except KeyError as e:
            raise GraphError(f"{source}: missing field {e.args[0]!r} in the OpGraph.") from None
        except TypeError as e:
            raise GraphError(f"{source}: malformed OpGraph ({e}).") from None
        except ArtifactError:
            raise
        try:
            return graph.validate()
        except GraphError as e:
            raise GraphError(f"{source}: {e}") from None
