"""The analytic cost model: roofline compute times per node × device type × batch × phase,
the memory model, and communication over the cluster — everything the simulator and the
search ask through the CostModel protocol (cost/model.py).

Compute time of one node (Williams, Waterman & Patterson, "Roofline", CACM 2009):

    t_math = F_tc / (P_tc · e(kind, n)) + F_other / (P_fp32 · E_VECTOR)
    t_mem  = bytes / (BW · e_mem)
    roof   = max(t_math, t_mem)
    GPU:   t = max(roof + k · kernel_gap, host / host_speed + cudnn)
           (host pacing: cost/host.py; host_speed: the device's node; cudnn: the cuDNN calls'
            own host time, not scaled by host_speed — see cost/host.py)
    CPU:   t = roof + k · dispatch                            (the host does the work itself)

F_tc is the node's FLOPs in matmul/conv/attention kernels (tensor_core_flops_fraction), k its
kernel count, n = (F_tc / k / 2)^(1/3) the equivalent square-product size that picks the
efficiency from the calibrated curve (cost/efficiency.py), times the GPU type's own sustained
factors (catalog `efficiency`, never above peak). P_tc by precision, as PyTorch runs
by default: fp32 — matmul and attention at the FP32 rate, cuDNN convolutions at TF32
(torch.backends.cudnn.allow_tf32 is on, cuda.matmul.allow_tf32 is off); tf32 — both on TF32
tensor cores; amp-bf16 — BF16 tensor cores; fp16 — FP16. A precision with no fast path on a
type runs at its FP32 rate (cost/precision.py says so to the user). Kernels PyTorch runs
differently from what the capture counts — normalisation passes, depthwise and
channel-padded convolutions — follow cost/kernels.py.
A measured profile (cost/profile.py), when given, replaces the estimate per node.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from heterog.cost import comm
from heterog.cost.efficiency import Curve, gpu_curve, memory_efficiency
from heterog.cost.host import autocast_casts, cudnn_calls, host_times_s
from heterog.cost.kernels import bandwidth_kind, conv_kernels, traffic_factors
from heterog.cost.memory import OPTIMIZER_STATE_COPIES, TENSOR_CORE_KINDS, MemoryModel, dtype_factors
from heterog.cost.profile import Profile
from heterog.errors import ClusterError, PlanError
from heterog.hardware.catalog import host_costs, host_overheads
from heterog.hardware.cluster import Cluster
from heterog.hardware.gputype import GpuType
from heterog.ir.kinds import Precision
from heterog.ir.opgraph import OpGraph

PRECISIONS = tuple(Precision)
E_VECTOR = 0.5  # non-tensor-core FLOPs: element-wise math rarely beats half of peak
# Kernel efficiency relative to a square GEMM of the same work. Attention kernels pay for the
# softmax between their two products. cuDNN convolutions on tensor cores (TF32/BF16/FP16) reach
# far less of the tensor-core peak than GEMMs do; on CUDA cores (FP32) about as much. The
# convolution factors are calibrated on NVIDIA's published ResNet-50 v1.5 PyTorch training
# throughputs (DeepLearningExamples performance tables, approximately: A100-80GB TF32 ~1000
# img/s, AMP ~2500; V100-16GB FP32 ~390, AMP ~1200), after the memory-bound BN/ReLU time.
KIND_FACTOR_GPU = {"matmul": 1.0, "attention": 0.7}
CONV_FACTOR_GPU = {"fp32": 1.0, "tf32": 0.4, "bf16": 0.4, "fp16": 0.4}
# Optimizer traffic per parameter byte (reads + writes of fp32 tensors) and ops per tensor.
# SGD-momentum: buf.mul_(m).add_(g) (2 + 3), p.add_(buf, -lr) (3).
# AdamW (torch.optim.adamw): p.mul_ (2), exp_avg.lerp_ (3), exp_avg_sq.mul_ (2) .addcmul_ (3),
# sqrt (2), div_ (2), add_ (2), p.addcdiv_ (4).
# Batch norm on bf16 input does not run cuDNN's kernels: PyTorch picks cuDNN only when
# `input.scalar_type() != at::kBFloat16` (ATen/native/Normalization.cpp,
# _select_batch_norm_backend), so under autocast-bf16 every batch norm of an NCHW CNN runs
# PyTorch's native CUDA kernels (a statistics pass, then the transform; more in backward).
# The H200 steps bound their speed: resnet50 at batch 128-256 takes 55.9 and 107 ms in
# amp-bf16 against 61.0 and 117 ms in fp32, where the fp32 op profile gives batch norm 21.8
# of 59.5 device-ms and convolutions 27.4; even with bf16 convolutions no faster than TF32
# ones, the bf16 batch norms and element-wise ops cannot have run faster than ~0.8× their
# fp32 time while moving half the bytes. Modelled as half the bandwidth of the kind (i.e.
# about the fp32 cuDNN kernel's time): a hypothesis from the source and the steps, chosen
# after resnet50's held-out error was seen (docs/cost_model.md says so); fp16 keeps cuDNN.
NATIVE_BN_BF16_FACTOR = 0.5
# Half-precision convolutions on NCHW tensors (PyTorch's default layout for CNNs; the zoo's
# and the H200 steps' resnet50 are NCHW): cuDNN's tensor-core kernels work on NHWC and "may
# use padding, folding, and NCHW-to-NHWC transformations" to reach them (cuDNN developer
# guide; channels_last is PyTorch's documented remedy). Modelled as one transpose of each
# activation the convolution reads or writes (in and out of NHWC: a read and a write each),
# i.e. twice the kernel's own activation traffic, as separate kernels at copy bandwidth,
# forward and backward. Not fitted: the count of transposes is the hypothesis. fp32/TF32
# keeps NCHW kernels. (resnet50's fp32 profile shows one such transform where visible: the
# stem convolution spends 1.24 of its 2.48 ms in a child kernel.)
NCHW_HALF_CONV_TRANSFORM_PASSES = 2.0
OPTIMIZER_BYTES_PER_PARAM_BYTE = {"sgd": 8.0, "adamw": 20.0}
OPTIMIZER_OPS_PER_TENSOR = {"sgd": 3, "adamw": 10}
ACCUMULATE_BYTES_PER_PARAM_BYTE = 3.0  # gradient accumulation: read both, write one
OPTIMIZER_TEMPORARIES = {"sgd": 0, "adamw": 2}  # out-of-place parameter-sized results per step
FRESH_PAGE_SHARE = 0.9  # tensors within 10% of the step's largest count as the largest


def _matmul_precision(kind: str, precision: str, gpu: GpuType) -> str:
    """The catalog precision whose peak a tensor-core kernel of `kind` runs at: the plan's
    (GpuType.catalog_precision, fp32 where the type has no fast path for it), except that
    PyTorch runs fp32 convolutions on TF32 tensor cores by default (cudnn.allow_tf32 is on,
    cuda.matmul.allow_tf32 off)."""
    return gpu.catalog_precision("tf32" if precision == "fp32" and kind == "conv" else precision)


class _TypeTable:
    """Per-node arrays for one GPU type, one precision, one phase: what the roofline needs."""

    def __init__(self, graph: OpGraph, gpu: GpuType, precision: str, phase: str):
        nodes = graph.nodes
        fw = phase == "fwd"
        flops_fixed = np.array([(n.fwd_flops if fw else n.bwd_flops).fixed for n in nodes])
        flops_ps = np.array([(n.fwd_flops if fw else n.bwd_flops).per_sample for n in nodes])
        tc = np.array(
            [
                n.tensor_core_flops_fraction if n.kind in TENSOR_CORE_KINDS or n.tensor_core_flops_fraction > 0 else 0.0
                for n in nodes
            ]
        )
        # traffic in the dtype of what the node writes (reads are mostly of the same size);
        # CPU kernels on half tensors convert to fp32 and back, so they gain no speed there
        factor = dtype_factors(graph, precision).out if gpu.vendor != "cpu" else np.ones(len(nodes))
        conv = np.array([n.kind == "conv" for n in nodes])
        convs = conv_kernels(graph, _matmul_precision("conv", precision, gpu)) if gpu.vendor != "cpu" else None
        if convs is not None:
            # kernels that read their input more than once; depthwise convolutions on CUDA
            # cores; channels padded to the tensor cores' alignment (cost/kernels.py)
            factor = factor * traffic_factors(graph, phase) * (1.0 if fw else convs.bwd_passes)
            tc = np.where(conv & ~convs.on_tensor_cores, 0.0, tc)
            flops_fixed = np.where(conv, flops_fixed * convs.flop_padding, flops_fixed)
            flops_ps = np.where(conv, flops_ps * convs.flop_padding, flops_ps)
        bytes_obj = [(n.fwd_bytes if fw else n.bwd_bytes) for n in nodes]
        self.bytes_fixed = np.array([b.fixed for b in bytes_obj]) * factor
        self.bytes_ps = np.array([b.per_sample for b in bytes_obj]) * factor
        self.casts = autocast_casts(graph, precision) if gpu.vendor != "cpu" else None
        if self.casts is not None:
            # autocast's casts (forward: weights and fp32 inputs to half; backward: their
            # gradients back to fp32) read 4 B and write 2 B per element, or the reverse
            self.bytes_fixed = self.bytes_fixed + self.casts.bytes_fixed
            self.bytes_ps = self.bytes_ps + self.casts.bytes_per_sample
        # NCHW convolutions in half precision: cuDNN's tensor-core kernels work on NHWC, so it
        # transforms the activations in and out (separate kernels, after the roofline)
        self.transform_ps = np.zeros(len(nodes))
        if precision in ("amp-bf16", "fp16") and gpu.vendor == "nvidia":
            act_ps = np.array([b.per_sample for b in bytes_obj]) * factor
            nchw_tc = conv & convs.on_tensor_cores & ~convs.nhwc
            self.transform_ps = np.where(nchw_tc, NCHW_HALF_CONV_TRANSFORM_PASSES * act_ps, 0.0)
        self.transform_bandwidth = gpu.memory_bandwidth_bytes_per_s * memory_efficiency(gpu)
        self.tc_fixed, self.tc_ps = flops_fixed * tc, flops_ps * tc
        self.other_fixed, self.other_ps = flops_fixed * (1 - tc), flops_ps * (1 - tc)
        kernels = np.array([float(n.fwd_kernels if fw else n.bwd_kernels) for n in nodes])
        has_work = (flops_fixed + flops_ps + self.bytes_fixed + self.bytes_ps) > 0
        self.kernels = np.where((kernels == 0) & has_work, 1.0, kernels)
        if self.casts is not None:
            self.kernels = self.kernels + self.casts.count
        # one curve per distinct (precision used) — conv may differ from matmul
        self.peak_tc = np.zeros(len(nodes))
        self.kind_factor = np.ones(len(nodes))
        self.curve_of: list[Curve] = []
        curve_index = np.zeros(len(nodes), dtype=np.int64)
        curves: dict[str, int] = {}
        for i, n in enumerate(nodes):
            p = _matmul_precision(n.kind, precision, gpu)
            if p not in curves:
                curves[p] = len(self.curve_of)
                self.curve_of.append(gpu_curve(gpu, p))
            curve_index[i] = curves[p]
            self.peak_tc[i] = gpu.peak_flops_per_s[p]
            self.kind_factor[i] = (
                _kind_factor(n.kind, gpu, p)
                * (gpu.efficiency.compute_factor(p) if gpu.vendor != "cpu" else 1.0)
                * (gpu.efficiency.conv_factor(p) if n.kind == "conv" and gpu.vendor != "cpu" else 1.0)
            )
        self.curve_index = curve_index
        self.peak_vector = gpu.peak_flops_per_s["fp32"] * E_VECTOR
        # GPUs: a batch norm pass streams like an element-wise kernel (cost/kernels.py)
        kind_of = [
            n.kind if convs is None else "elementwise" if c and not on_tc else bandwidth_kind(n)
            for n, c, on_tc in zip(nodes, conv, np.ones(len(nodes), bool) if convs is None else convs.on_tensor_cores)
        ]
        kind_eff = {k: memory_efficiency(gpu, k, phase) for k in set(kind_of)}
        self.bandwidth = gpu.memory_bandwidth_bytes_per_s * np.array([kind_eff[k] for k in kind_of])
        if precision == "amp-bf16" and gpu.vendor != "cpu":
            bn = np.array([_is_batch_norm(n) for n in nodes])
            self.bandwidth = np.where(bn, self.bandwidth * NATIVE_BN_BF16_FACTOR, self.bandwidth)
        # bytes per element of the tensor-core operands, for the intensity-derived size
        self.element_bytes = 2.0 if precision in ("amp-bf16", "fp16") else 4.0
        oh = host_overheads(gpu)
        self.synchronous = oh.synchronous
        self.dispatch = oh.dispatch_s if fw or oh.backward_dispatch_s is None else oh.backward_dispatch_s
        self.kernel_gap = oh.kernel_gap_s
        # GPU: the host's time per node (dispatch, autograd, autocast), paced op by op
        self.host_s = None if self.synchronous else host_times_s(graph, host_costs(gpu), phase, self.casts)
        # cuDNN's plan look-ups: host time that the node's host_speed does not scale (cost/host.py)
        self.cudnn_s = None if self.synchronous else host_costs(gpu).cudnn_op_s * cudnn_calls(graph, precision, gpu)
        # CPU: outputs (forward) and gradients (backward) above glibc's mmap threshold land
        # on fresh pages every step; workspace_bytes is the largest such tensor a node makes
        big = oh.fresh_threshold_bytes
        out = np.array([n.output_bytes.fixed for n in nodes]), np.array([n.output_bytes.per_sample for n in nodes])
        work = (
            np.array([n.workspace_bytes.fixed for n in nodes]),
            np.array([n.workspace_bytes.per_sample for n in nodes]),
        )
        self._fresh = (oh.fresh_page_s_per_byte, big, out if fw else (np.zeros(len(nodes)), np.zeros(len(nodes))), work)
        # CPU: a floor per output element for dropout (random numbers) and GELU (erf), measured
        self._element_s = np.zeros(len(nodes))
        if self.synchronous and fw:
            from heterog.hardware.catalog import measure_cpu

            per_element = measure_cpu(gpu.cpu_threads).element_s
            for i, n in enumerate(nodes):
                for key, t in per_element.items():
                    if key in n.module_type.lower():
                        self._element_s[i] = t / 4.0  # per fp32 output byte
        self._has_element_floor = bool(self._element_s.any())
        self._out_fixed, self._out_ps = out

    def times_s(self, idx: np.ndarray, batch: float, host_scale: float = 1.0) -> np.ndarray:
        """Times of nodes `idx` at `batch`; `host_scale` multiplies the host's time per node
        (1 / the node's host_speed: a slower host paces the GPU later)."""
        tc = self.tc_fixed[idx] + self.tc_ps[idx] * batch
        other = self.other_fixed[idx] + self.other_ps[idx] * batch
        nbytes = self.bytes_fixed[idx] + self.bytes_ps[idx] * batch
        k = self.kernels[idx]
        # The equivalent square product: by work per kernel (n³ = F/2k). On a CPU also by
        # arithmetic intensity, since a skinny product (a convolution over 3 input channels,
        # a 1×1 convolution) reuses its operands as badly as a small square one: a square
        # n-product moves 3n²·e bytes for 2n³ FLOPs, so n = 1.5·e·F/bytes. (On a GPU the
        # roofline's memory term already charges low intensity; the H200 curve includes it.)
        size = np.cbrt(np.maximum(tc / np.maximum(k, 1.0) / 2.0, 1.0))
        if self.synchronous:
            by_intensity = 1.5 * self.element_bytes * tc / np.maximum(nbytes, 1.0)
            size = np.where(nbytes > 0, np.minimum(size, by_intensity), size)
        eff = np.empty(len(idx))
        ci = self.curve_index[idx]
        for c, curve in enumerate(self.curve_of):
            sel = ci == c
            if sel.any():
                eff[sel] = curve.at(size[sel])
        # a kernel never beats the data-sheet peak, whatever the type's fitted factors say
        t_math = tc / (self.peak_tc[idx] * np.minimum(eff * self.kind_factor[idx], 1.0)) + other / self.peak_vector
        roof = (
            np.maximum(t_math, nbytes / self.bandwidth[idx]) + self.transform_ps[idx] * batch / self.transform_bandwidth
        )
        if self.synchronous:
            per_byte, big, (of, op), (wf, wp) = self._fresh
            if per_byte > 0:
                o, w = of[idx] + op[idx] * batch, wf[idx] + wp[idx] * batch
                roof = roof + per_byte * (np.where(o > big, o, 0.0) + np.where(w > big, w, 0.0))
            if self._has_element_floor:
                o = self._out_fixed[idx] + self._out_ps[idx] * batch
                roof = np.maximum(roof, self._element_s[idx] * o)
            return roof + k * self.dispatch
        # The host runs ahead while the GPU is busy and the GPU idles while the host is
        # behind: each node takes whichever is longer (cost/host.py)
        return np.maximum(roof + k * self.kernel_gap, self.host_s[idx] * host_scale + self.cudnn_s[idx])


def _is_batch_norm(node) -> bool:
    return node.kind == "norm" and "batchnorm" in node.module_type.lower()


def _kind_factor(kind: str, gpu: GpuType, precision: str) -> float:
    if gpu.vendor != "cpu":
        if kind == "conv":
            return CONV_FACTOR_GPU[precision]
        return KIND_FACTOR_GPU.get(kind, 1.0)
    if kind == "conv":
        from heterog.hardware.catalog import measure_cpu

        p = measure_cpu(gpu.cpu_threads)
        # oneDNN convolutions vs the same work as GEMM, measured on this machine
        return float(np.clip(p.conv_flops_per_s / p.peak_flops_per_s, 0.25, 2.0))
    return 1.0 if kind == "matmul" else 0.8


class AnalyticCostModel:
    """Implements heterog.cost.model.CostModel for one graph, cluster, precision, optimizer."""

    def __init__(
        self,
        graph: OpGraph,
        cluster: Cluster,
        *,
        precision: str = "fp32",
        optimizer: str = "sgd",
        profile: Profile | None = None,
        recompute: bool = False,
    ):
        if precision not in PRECISIONS:
            raise PlanError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
        self.graph = graph
        self.cluster = cluster
        self.precision = precision
        self.optimizer = optimizer
        self.recompute = recompute
        self.profile = profile
        allocator = "cpu" if all(g.vendor == "cpu" for g in cluster.gpu_types.values()) else "cuda"
        self.memory = MemoryModel(graph, precision=precision, optimizer=optimizer, allocator=allocator)
        self._tables: dict[tuple[str, str], _TypeTable] = {}
        self._node_cache: dict[tuple[int, str, float, float, str], float] = {}
        self._index_cache: dict[tuple[str, ...], np.ndarray] = {}
        self._in_block = self.memory.in_block()
        self._edges = {(e.src, e.dst): e.bytes for e in graph.edges}
        self._comm_cache: dict[tuple, tuple[float, float]] = {}
        self._n_tensors = np.array([float(len(n.param_names) or (1 if n.param_count else 0)) for n in graph.nodes])
        if profile is not None:
            profile.check_against(graph)

    # -- helpers ------------------------------------------------------------------------------
    def _table(self, gpu_type: str, phase: str) -> _TypeTable:
        key = (gpu_type, phase)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _TypeTable(self.graph, self.cluster.gpu_types[gpu_type], self.precision, phase)
        return t

    def _idx(self, nodes: Sequence[str]) -> np.ndarray:
        key = tuple(nodes)
        idx = self._index_cache.get(key)
        if idx is None:
            gi = self.graph.index
            try:
                idx = np.fromiter((gi[n] for n in key), dtype=np.int64, count=len(key))
            except KeyError as e:
                raise PlanError(f"node {e.args[0]!r} is not in the graph of {self.graph.model}.") from None
            self._index_cache[key] = idx
        return idx

    def _device(self, device: str):
        try:
            return self.cluster.device(device)
        except ClusterError:
            raise

    def _host_scale(self, device: str) -> float:
        """How much longer than the reference host this device's host takes per op."""
        return 1.0 / self.cluster.host_speed(device)

    def _phase_times_s(
        self, idx: np.ndarray, gpu_type: str, batch: float, phase: str, host_scale: float = 1.0
    ) -> np.ndarray:
        if phase not in ("fwd", "bwd"):
            raise PlanError(f"unknown phase {phase!r}; use 'fwd' or 'bwd'.")
        times = self._table(gpu_type, phase).times_s(idx, batch, host_scale)
        if self.profile is not None:
            for j, i in enumerate(idx):
                measured = self.profile.time_s(self.graph.nodes[i].name, gpu_type, phase, batch)
                if measured is not None:
                    times[j] = measured
        if phase == "bwd" and self.recompute:
            fwd = self._phase_times_s(idx, gpu_type, batch, "fwd", host_scale)
            times = times + np.where(self._in_block[idx], fwd, 0.0)
        return times

    # -- compute --------------------------------------------------------------------------------
    def compute_time_s(self, node: str, device: str, batch: float, phase: str) -> float:
        if batch <= 0:
            return 0.0
        d = self._device(device)
        i = self.graph.index.get(node)
        if i is None:
            raise PlanError(f"node {node!r} is not in the graph of {self.graph.model}.")
        scale = self._host_scale(device)
        key = (i, d.gpu_type, scale, float(batch), phase)
        t = self._node_cache.get(key)
        if t is None:
            t = self._node_cache[key] = float(self._phase_times_s(np.array([i]), d.gpu_type, batch, phase, scale)[0])
        return t * d.slowdown

    def group_time_s(self, nodes: Sequence[str], device: str, batch: float, phase: str) -> float:
        """Sum of compute_time_s over `nodes` (vectorised; the search's hot path)."""
        if batch <= 0 or not nodes:
            return 0.0
        d = self._device(device)
        return (
            float(self._phase_times_s(self._idx(nodes), d.gpu_type, batch, phase, self._host_scale(device)).sum())
            * d.slowdown
        )

    def node_times_s(self, nodes: Sequence[str], device: str, batch: float, phase: str) -> np.ndarray:
        """compute_time_s of every node in `nodes`, as an array."""
        if batch <= 0 or not nodes:
            return np.zeros(len(nodes))
        d = self._device(device)
        return self._phase_times_s(self._idx(nodes), d.gpu_type, batch, phase, self._host_scale(device)) * d.slowdown

    def recompute_time_s(self, nodes: Sequence[str], device: str, batch: float) -> float:
        """Extra backward time if `nodes` are recomputed (their block members' forward again);
        already included in 'bwd' times when the model was built with recompute=True."""
        if batch <= 0 or not nodes:
            return 0.0
        d = self._device(device)
        idx = self._idx(nodes)
        fwd = self._table(d.gpu_type, "fwd").times_s(idx, batch, self._host_scale(device))
        return float(np.where(self._in_block[idx], fwd, 0.0).sum()) * d.slowdown

    def _parameter_pass(self, nodes: Sequence[str], device: str, bytes_per_param_byte: float):
        """A pass over the parameters of `nodes` on `device` (the optimizer step, a gradient
        accumulation): (their indices, the device, its type, the streaming time at the memory
        rate the optimizer reaches), or None without parameters."""
        idx = self._idx(nodes)
        pbytes = float(self.memory.param_bytes[idx].sum())
        if pbytes <= 0:
            return None
        d = self._device(device)
        gpu = self.cluster.gpu_types[d.gpu_type]
        return (
            idx,
            d,
            gpu,
            bytes_per_param_byte * pbytes / (gpu.memory_bandwidth_bytes_per_s * memory_efficiency(gpu, "optimizer")),
        )

    def optimizer_time_s(self, nodes: Sequence[str], device: str) -> float:
        p = self._parameter_pass(nodes, device, OPTIMIZER_BYTES_PER_PARAM_BYTE[self.optimizer])
        if p is None:
            return 0.0
        idx, d, gpu, traffic_s = p
        oh = host_overheads(gpu)
        tensors = float(self._n_tensors[idx].sum())
        if oh.synchronous:
            # CPU: torch.optim's default is the per-tensor for-loop (foreach is CUDA-only);
            # AdamW's two out-of-place temporaries (sqrt, division) per tensor land on fresh
            # pages when larger than glibc's mmap threshold
            host_s = tensors * OPTIMIZER_OPS_PER_TENSOR[self.optimizer] * oh.dispatch_s
            # In the optimizer step, after the activations are freed, the largest parameter's
            # temporaries are the largest blocks: glibc's threshold (raised to the largest
            # block freed, at most 32 MiB) sends them, and those near their size, to fresh pages.
            per_node = self.memory.param_bytes[idx]
            big = min(oh.fresh_threshold_bytes, FRESH_PAGE_SHARE * float(self.memory.param_bytes.max(initial=0.0)))
            fresh_s = (
                OPTIMIZER_TEMPORARIES[self.optimizer]
                * oh.fresh_page_s_per_byte
                * float(per_node[per_node >= big].sum())
            )
            return (traffic_s + host_s + fresh_s) * d.slowdown
        # GPU: foreach kernels; host cost per tensor overlaps the device's streaming
        return max(traffic_s, tensors * oh.optimizer_per_tensor_s * self._host_scale(device)) * d.slowdown

    def accumulate_time_s(self, nodes: Sequence[str], device: str) -> float:
        """autograd's AccumulateGrad: `grad += new` per parameter, reading two and writing one
        parameter-sized tensor, one op per tensor. On this CPU a pipeline stage holding most of
        the toy CNN's 16.5 MB of parameters paid a few ms per micro-batch for it, ~0.2 s a GPipe
        step of 16 micro-batches on a 3×-paced device that the profile (one backward per step)
        did not see."""
        p = self._parameter_pass(nodes, device, ACCUMULATE_BYTES_PER_PARAM_BYTE)
        if p is None:
            return 0.0
        idx, d, gpu, traffic_s = p
        if host_overheads(gpu).synchronous:
            return (traffic_s + float(self._n_tensors[idx].sum()) * host_overheads(gpu).dispatch_s) * d.slowdown
        return traffic_s * d.slowdown

    # -- communication ---------------------------------------------------------------------------
    def transfer_time_s(self, nbytes: float, src: str, dst: str) -> float:
        return comm.p2p_time_s(self.cluster, nbytes, src, dst)

    def collective_time_s(self, op: str, nbytes: float, devices: Sequence[str], method: str = "ring") -> float:
        return comm.cached_collective_time_s(self._comm_cache, self.cluster, op, nbytes, devices, method)

    def ps_sync_time_s(self, nbytes: float, devices: Sequence[str], server: str) -> float:
        return comm.cached_ps_sync_time_s(self._comm_cache, self.cluster, nbytes, devices, server)

    # -- memory ----------------------------------------------------------------------------------
    def persistent_bytes(self, nodes: Sequence[str], device: str) -> float:
        self._device(device)
        return self.memory.persistent_bytes(self._idx(nodes))

    def optimizer_state_bytes(self, nodes: Sequence[str], device: str) -> float:
        self._device(device)
        return self.memory.optimizer_state_bytes(self._idx(nodes))

    def tied_copy_bytes(self, param_bytes: float, device: str) -> float:
        self._device(device)
        return (2 + OPTIMIZER_STATE_COPIES[self.optimizer]) * float(param_bytes)

    def activation_bytes(self, nodes: Sequence[str], batch: float, recompute: bool = False) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.saved_bytes(self._idx(nodes), batch, recompute or self.recompute)

    def recompute_transient_bytes(self, nodes: Sequence[str], batch: float) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.recompute_transient_bytes(self._idx(nodes), batch)

    def workspace_bytes(self, nodes: Sequence[str], batch: float) -> float:
        if batch <= 0 or not nodes:
            return 0.0
        return self.memory.workspace_bytes(self._idx(nodes), batch)

    def gradient_bytes(self, nodes: Sequence[str]) -> float:
        return self.memory.grads_bytes(self._idx(nodes))

    def activation_transfer_bytes(self, src: str, dst: str, batch: float) -> float:
        b = self._edges.get((src, dst))
        if b is None or batch <= 0:
            return 0.0
        return b.at(batch) * self.memory.dtypes.out[self.graph.index[src]]
