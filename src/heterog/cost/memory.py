"""Memory model: what one replica of a set of OpGraph nodes holds, and the peak of a whole
training step on one device.

Persistent state per parameter (fp32 master weights in every precision, as torch.autocast
keeps them): weights, gradients, and optimizer state — SGD with momentum one copy (the
momentum buffer), AdamW two (exp_avg, exp_avg_sq) (torch.optim docs).

Activations are what autograd saves for backward (OpNode.saved_bytes, de-duplicated by the
capture). Under amp-bf16/fp16 the tensors produced by autocast-eligible ops are half size,
and autocast's bf16 copy of each weight is saved for the backward of its matmul/conv.

Recompute (activation checkpointing of each transformer/residual block, inferred from module
paths): a block keeps only its inputs; during its backward its activations exist again, one
block at a time.

Allocator: PyTorch's CUDA caching allocator rounds every block to 512 B and carves blocks
from 2 MiB segments (small pool, ≤ 1 MiB requests) or larger segments; the gap between
reserved and allocated memory (fragmentation) is modelled as a fraction of the peak.
(PyTorch docs, "CUDA semantics — memory management"; c10/cuda/CUDACachingAllocator.cpp.)
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from heterog.errors import PlanError
from heterog.ir.affine import ZERO, Affine
from heterog.ir.kinds import HALF_PRECISIONS
from heterog.ir.opgraph import OpGraph

OPTIMIZER_STATE_COPIES = {"sgd": 1, "adamw": 2}
# Share of a parameter tensor an optimizer step allocates as temporaries: AdamW's foreach
# path materialises sqrt(exp_avg_sq) for all parameters; SGD with momentum updates in place.
OPTIMIZER_TRANSIENT_COPIES = {"sgd": 0.0, "adamw": 1.0}
# Op kinds whose outputs autocast produces in half precision (matmul/conv inputs and the
# element-wise ops that follow keep that dtype); norms, embeddings and losses stay fp32.
HALF_UNDER_AUTOCAST = frozenset({"matmul", "conv", "attention", "elementwise", "pool", "memory"})
TENSOR_CORE_KINDS = frozenset({"matmul", "conv", "attention"})
CUDA_BLOCK_BYTES = 512
CUDA_SEGMENT_BYTES = 2 * 2**20
# reserved / allocated − 1 at the peak: 5–10% is typical for training; the larger value keeps
# `fits` conservative (a configuration predicted to fit must not run out of memory)
FRAGMENTATION = {"cuda": 0.10, "cpu": 0.0}
CUDA_CONTEXT_BYTES = 500 * 2**20  # CUDA context + cuBLAS/cuDNN handles (not in the allocator)
# What the CUDA process holds in the caching allocator besides the step's tensors, whatever
# the model — a property of the process, taken as a constant: measured on the H200 steps as
# the smallest step's peak minus the tensors this model counts (benchmarks/predict_gpu.py
# fit_memory: resnet50, batch 1, amp-bf16; bert-large's smallest steps show 69 MiB). Most of
# it is presumably two 32 MiB cuBLAS workspaces (PyTorch allocates one per handle and stream
# through the allocator, 32 MiB on Hopper: ATen/cuda/CublasHandlePool.cpp; forward and the
# autograd engine's thread each hold a handle) and cuDNN convolution workspace.
CUDA_FIXED_BYTES = 78_253_720.0  # 74.6 MiB

_INDEX = re.compile(r"^\d+$")


def block_of(module_path: str) -> str | None:
    """The repeated block a module belongs to: its path up to the first numeric component
    ('transformer.h.3.attn.c_attn' → 'transformer.h.3', 'layer1.0.conv1' → 'layer1.0')."""
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if _INDEX.match(p):
            return ".".join(parts[: i + 1])
    return None


def activation_factor(kind: str, precision: str) -> float:
    """A node-local guess (no graph): half for the kinds autocast usually leaves in half."""
    if precision in HALF_PRECISIONS and kind in HALF_UNDER_AUTOCAST:
        return 0.5
    return 1.0


@dataclass(frozen=True, slots=True)
class DtypeFactors:
    """Per node, the size of its tensors relative to fp32 under the precision: outputs, saved
    tensors, and the gradient of its inputs (as its backward first produces it)."""

    out: np.ndarray
    saved: np.ndarray
    grad_in: np.ndarray

    def edge(self, src_index: int) -> float:
        return float(self.out[src_index])


# Modules built on an op of autocast's fp32 list: GPT-2's tanh-approximated GELU starts with
# torch.pow (fp32 list, torch/csrc/autograd/autocast_mode.cpp), so it and the element-wise
# chain after it run in fp32 (transformers/activations.py, NewGELUActivation).
FP32_LIST_MODULES = frozenset({"newgeluactivation", "fastgeluactivation"})


def forced_fp32(node) -> bool:
    """Ops autocast runs in fp32 whatever their inputs (its fp32 list: layer_norm, group_norm,
    softmax-based losses, pow, ...); a batch norm keeps its input dtype."""
    if node.kind == "loss" or node.module_type.lower() in FP32_LIST_MODULES:
        return True
    return node.kind == "norm" and "batchnorm" not in node.module_type.lower()


def dtype_factors(graph: OpGraph, precision: str) -> DtypeFactors:
    """Propagate dtypes through the graph the way torch.autocast does: matmul/conv/attention
    produce half; fp32-list ops (layer norm, losses) produce fp32; everything else produces
    half only if all its inputs are half (PyTorch type promotion: a half tensor added to
    the fp32 residual stream gives fp32). Graph inputs and embeddings are fp32."""
    n = len(graph.nodes)
    ones = np.ones(n)
    if precision not in HALF_PRECISIONS:
        return DtypeFactors(ones, ones.copy(), ones.copy())
    preds = graph.predecessors
    gi = graph.index
    half = np.zeros(n, dtype=bool)
    inputs_half = np.zeros(n, dtype=bool)
    for i, node in enumerate(graph.nodes):
        ps = preds[node.name]
        inputs_half[i] = bool(ps) and all(half[gi[p]] for p in ps)
        if node.kind in TENSOR_CORE_KINDS:
            half[i] = True
        elif forced_fp32(node) or node.kind == "embedding":
            half[i] = False
        else:
            half[i] = inputs_half[i]
    forced = np.array([forced_fp32(node) for node in graph.nodes])
    tc = np.array([node.kind in TENSOR_CORE_KINDS for node in graph.nodes])
    out = np.where(half, 0.5, 1.0)
    # saved tensors are mostly inputs: matmul/conv save the half copies autocast made of
    # theirs; fp32-list ops save fp32 copies; the rest save inputs as they came
    # (max pooling saves int64 indices, whatever the dtype; its input is saved by its producer)
    pool = np.array([node.kind == "pool" for node in graph.nodes])
    saved = np.where(tc, 0.5, np.where(forced | pool, 1.0, np.where(inputs_half, 0.5, 1.0)))
    # an fp32-list op's backward makes its input gradient in fp32 before casting it back
    grad_in = np.where(forced, 1.0, np.nan)
    return DtypeFactors(out, saved, grad_in)


def round_allocation(nbytes: float, allocator: str) -> float:
    if allocator == "cuda" and nbytes > 0:
        return math.ceil(nbytes / CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMemory:
    """The peak of one training step on one device, and what it is made of (bytes)."""

    peak_bytes: float
    params_bytes: float
    grads_bytes: float
    optimizer_state_bytes: float
    activations_bytes: float  # saved for backward at the peak's batch (after recompute)
    transient_bytes: float  # workspace + in-flight gradients at the peak
    peak_phase: str  # 'forward', 'backward', 'optimizer'
    reserved_bytes: float  # with allocator fragmentation; `fits` compares this

    def to_dict(self) -> dict[str, float | str]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class MemoryModel:
    """Per-node memory terms as arrays over the graph, summed for any subset of nodes."""

    def __init__(
        self,
        graph: OpGraph,
        *,
        precision: str = "fp32",
        optimizer: str = "sgd",
        allocator: str = "cuda",
        fixed_bytes: float | None = None,
    ):
        if optimizer not in OPTIMIZER_STATE_COPIES:
            raise PlanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_COPIES)}.")
        self.graph = graph
        self.precision = precision
        self.optimizer = optimizer
        self.allocator = allocator
        self.fixed_bytes = (CUDA_FIXED_BYTES if allocator == "cuda" else 0.0) if fixed_bytes is None else fixed_bytes
        nodes = graph.nodes
        half = precision in HALF_PRECISIONS
        self.param_bytes = np.array([float(n.param_bytes) for n in nodes])
        self.dtypes = dtype_factors(graph, precision)
        out_f, saved_f = self.dtypes.out, self.dtypes.saved
        # autocast's half copy of each tensor-core weight, saved for backward (batch-independent).
        # A tied weight (a language-model head sharing the embedding) is owned by its first
        # user, so the weight a node reads is taken from its batch-independent traffic too.
        cast = np.array(
            [
                max(2.0 * n.param_count, 0.5 * n.fwd_bytes.fixed) if half and n.kind in TENSOR_CORE_KINDS else 0.0
                for n in nodes
            ]
        )
        self.saved_fixed = np.array([n.saved_bytes.fixed for n in nodes]) * saved_f + cast
        self.saved_per_sample = np.array([n.saved_bytes.per_sample for n in nodes]) * saved_f
        # the largest transient of an fp32-list op is fp32 (its upcast input, its gradients)
        work_f = np.where(np.isnan(self.dtypes.grad_in), out_f, 1.0)
        self.work_fixed = np.array([n.workspace_bytes.fixed for n in nodes]) * work_f
        self.work_per_sample = np.array([n.workspace_bytes.per_sample for n in nodes]) * work_f
        self.out_fixed = np.array([n.output_bytes.fixed for n in nodes]) * out_f
        self.out_per_sample = np.array([n.output_bytes.per_sample for n in nodes]) * out_f
        self.in_fixed, self.in_per_sample = self._input_arrays()
        self._chained_backward = np.array([n.bwd_kernels >= 2 and n.kind not in ("matmul", "conv") for n in nodes])
        self._blocks = self._find_blocks()
        self._block_inputs: dict[str, Affine] = {}
        self._in_block_mask: np.ndarray | None = None
        self._block_arrays_cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _input_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Bytes of each node's inputs from other nodes (each source once): the size of the
        input gradient its backward produces. Without edges, the previous node's output."""
        n = len(self.graph.nodes)
        per_dst: list[dict[str, Affine]] = [dict() for _ in range(n)]
        gi = self.graph.index
        for e in self.graph.edges:
            f = self.dtypes.out[gi[e.src]]
            forced = self.dtypes.grad_in[gi[e.dst]]
            if not np.isnan(forced):
                f = forced
            d = per_dst[gi[e.dst]]
            b = e.bytes.scaled(f)
            if e.src not in d or b.at(1) > d[e.src].at(1):
                d[e.src] = b
        fixed, per_sample = np.zeros(n), np.zeros(n)
        for i, d in enumerate(per_dst):
            if d:
                fixed[i] = sum(b.fixed for b in d.values())
                per_sample[i] = sum(b.per_sample for b in d.values())
            elif i > 0 and not self.graph.edges:
                fixed[i], per_sample[i] = self.out_fixed[i - 1], self.out_per_sample[i - 1]
        return fixed, per_sample

    # -- blocks for recompute -----------------------------------------------------------------
    def _find_blocks(self) -> dict[str, list[int]]:
        blocks: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(self.graph.nodes):
            b = block_of(n.module_path)
            if b is not None:
                blocks[b].append(i)
        return {b: idx for b, idx in blocks.items() if len(idx) >= 2}

    @property
    def blocks(self) -> dict[str, list[int]]:
        return self._blocks

    def block_input_bytes(self, block: str) -> Affine:
        """Bytes of the tensors entering a block from outside it (each source once)."""
        cached = self._block_inputs.get(block)
        if cached is None:
            cached = self._block_inputs[block] = self._block_input_bytes(block)
        return cached

    def _block_input_bytes(self, block: str) -> Affine:
        idx = self._blocks[block]
        names = {self.graph.nodes[i].name for i in idx}
        per_src: dict[str, Affine] = {}
        for e in self.graph.edges:
            if e.dst in names and e.src not in names:
                f = self.dtypes.out[self.graph.index[e.src]]
                b = e.bytes.scaled(f)
                if e.src not in per_src or b.at(1) > per_src[e.src].at(1):
                    per_src[e.src] = b
        if per_src:
            total = ZERO
            for b in per_src.values():
                total = total + b
            return total
        first = idx[0]  # no edges recorded: the previous node's output feeds the block
        if first == 0:
            return ZERO
        return Affine(self.out_fixed[first - 1], self.out_per_sample[first - 1])

    def in_block(self) -> np.ndarray:
        if self._in_block_mask is None:
            mask = np.zeros(len(self.graph.nodes), dtype=bool)
            for idx in self._blocks.values():
                mask[idx] = True
            self._in_block_mask = mask
        return self._in_block_mask

    # -- sums over node subsets --------------------------------------------------------------
    def index(self, nodes: Iterable[str]) -> np.ndarray:
        gi = self.graph.index
        return np.fromiter((gi[n] for n in nodes), dtype=np.int64)

    def params_bytes(self, idx: np.ndarray) -> float:
        return float(self.param_bytes[idx].sum())

    def grads_bytes(self, idx: np.ndarray) -> float:
        return self.params_bytes(idx)  # gradients in the master (parameter) dtype

    def optimizer_state_bytes(self, idx: np.ndarray) -> float:
        return OPTIMIZER_STATE_COPIES[self.optimizer] * self.params_bytes(idx)

    def persistent_bytes(self, idx: np.ndarray) -> float:
        return (2 + OPTIMIZER_STATE_COPIES[self.optimizer]) * self.params_bytes(idx)

    def saved_bytes(self, idx: np.ndarray, batch: float, recompute: bool = False) -> float:
        """Activations kept from forward to backward; with recompute only the block inputs
        (and nodes outside any block) are kept — see recompute_transient_bytes for the rest."""
        per_node = self.saved_fixed[idx] + self.saved_per_sample[idx] * batch
        if not recompute or not self._blocks:
            return float(per_node.sum())
        block_id, in_fixed, in_ps = self._block_arrays()
        ids = block_id[idx]
        mask = ids >= 0
        total = float(per_node[~mask].sum())
        if not mask.any():
            return total
        present = np.bincount(ids[mask], minlength=len(in_fixed)) > 0
        return total + float((in_fixed[present] + in_ps[present] * batch).sum())

    def recompute_transient_bytes(self, idx: np.ndarray, batch: float) -> float:
        """With recompute, the activations one block rebuilds in its backward: the largest
        block among `idx` (counted once per device by the caller, not once per group)."""
        if not self._blocks or len(idx) == 0:
            return 0.0
        per_node = self.saved_fixed[idx] + self.saved_per_sample[idx] * batch
        block_id, in_fixed, _ = self._block_arrays()
        ids = block_id[idx]
        mask = ids >= 0
        if not mask.any():
            return 0.0
        return float(np.bincount(ids[mask], weights=per_node[mask], minlength=len(in_fixed)).max())

    def _block_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block number of every node (−1: none) and each block's input bytes (fixed, per sample)."""
        if self._block_arrays_cache is None:
            block_id = np.full(len(self.graph.nodes), -1, dtype=np.int64)
            fixed, per_sample = [], []
            for k, (b, bidx) in enumerate(self._blocks.items()):
                block_id[bidx] = k
                a = self.block_input_bytes(b)
                fixed.append(a.fixed)
                per_sample.append(a.per_sample)
            self._block_arrays_cache = (block_id, np.array(fixed), np.array(per_sample))
        return self._block_arrays_cache

    def workspace_bytes(self, idx: np.ndarray, batch: float) -> float:
        if len(idx) == 0:
            return 0.0
        return float((self.work_fixed[idx] + self.work_per_sample[idx] * batch).max())

    # -- the whole step on one device ------------------------------------------------------------
    def step_peak(self, batch: float, *, recompute: bool = False) -> StepMemory:
        """Walk forward then backward through the nodes in execution order, tracking what is
        live: persistent state, saved activations, gradients as they appear, and each node's
        output, output-gradient and workspace while it runs (zero_grad(set_to_none=True) before
        the forward, the PyTorch default, so gradients do not exist during the forward)."""
        n = len(self.graph.nodes)
        all_idx = np.arange(n)
        params = self.params_bytes(all_idx)
        opt = self.optimizer_state_bytes(all_idx)
        # the batch itself stays live through the step (the caller holds it)
        base = params + opt + self.graph.input_bytes.at(batch) + self.fixed_bytes
        saved = self.saved_fixed + self.saved_per_sample * batch
        out = self.out_fixed + self.out_per_sample * batch
        work = self.work_fixed + self.work_per_sample * batch
        if recompute and self._blocks:
            saved_eff = saved.copy()
            block_total = {}
            for b, bidx in self._blocks.items():
                block_total[b] = float(saved[bidx].sum())
                saved_eff[bidx] = 0.0
                saved_eff[bidx[0]] = self.block_input_bytes(b).at(batch)
            extra_bwd = max(block_total.values(), default=0.0)
        else:
            saved_eff, extra_bwd = saved, 0.0
        cum_saved = np.cumsum(saved_eff)
        fwd_live = base + cum_saved + out + work
        fwd_peak_i = int(np.argmax(fwd_live)) if n else 0
        fwd_peak = float(fwd_live[fwd_peak_i]) if n else base
        # backward of node i: saved activations of nodes ≤ i still held, gradients of nodes
        # ≥ i (its own included) and in flight the gradient of its output — or, for a node of
        # several ops, the largest gradient inside it (workspace_bytes: the largest backward
        # output the capture saw) — plus the gradient of its inputs.
        grads_from = np.cumsum(self.param_bytes[::-1])[::-1]
        grad_in = self.in_fixed + self.in_per_sample * batch
        # matmul/conv backward ops are parallel branches (input and weight gradient, the
        # latter already in grads_from), not a chain: their workspace adds nothing new.
        internal = np.where(self._chained_backward, work, 0.0)
        bwd_live = base + cum_saved + grads_from + np.maximum(out, internal) + grad_in + extra_bwd
        bwd_peak_i = int(np.argmax(bwd_live)) if n else 0
        bwd_peak = float(bwd_live[bwd_peak_i]) if n else base
        opt_transient = OPTIMIZER_TRANSIENT_COPIES[self.optimizer] * params
        opt_peak = params + opt + params + opt_transient + self.fixed_bytes
        phase, peak = max(
            (("forward", fwd_peak), ("backward", bwd_peak), ("optimizer", opt_peak)), key=lambda kv: kv[1]
        )
        if phase == "forward":
            acts, grads = float(cum_saved[fwd_peak_i]), 0.0
        elif phase == "backward":
            acts, grads = float(cum_saved[bwd_peak_i]) + extra_bwd, float(grads_from[bwd_peak_i])
        else:
            acts, grads = 0.0, params
        transient = peak - params - opt - acts - grads  # includes the input batch
        reserved = peak * (1 + FRAGMENTATION.get(self.allocator, 0.0))
        if self.allocator == "cuda":
            reserved = math.ceil(reserved / CUDA_SEGMENT_BYTES) * CUDA_SEGMENT_BYTES
        return StepMemory(
            peak_bytes=peak,
            params_bytes=params,
            grads_bytes=grads,
            optimizer_state_bytes=opt,
            activations_bytes=acts,
            transient_bytes=max(transient, 0.0),
            peak_phase=phase,
            reserved_bytes=reserved,
        )

    def total_saved_bytes(self, batch: float, recompute: bool = False) -> float:
        return self.saved_bytes(np.arange(len(self.graph.nodes)), batch, recompute)


def node_indices(graph: OpGraph, nodes: Sequence[str]) -> np.ndarray:
    gi = graph.index
    return np.fromiter((gi[n] for n in nodes), dtype=np.int64, count=len(nodes))
