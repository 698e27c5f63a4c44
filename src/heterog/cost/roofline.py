"""Roofline compute times: per-node arrays for one GPU type, precision and phase, from which
the analytic cost model (cost/analytic.py) answers every compute question.

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
efficiency from the calibrated curve (hardware/efficiency.py), times the GPU type's own sustained
factors (catalog `efficiency`, never above peak). P_tc by precision, as PyTorch runs
by default: fp32 — matmul and attention at the FP32 rate, cuDNN convolutions at TF32
(torch.backends.cudnn.allow_tf32 is on, cuda.matmul.allow_tf32 is off); tf32 — both on TF32
tensor cores; amp-bf16 — BF16 tensor cores; fp16 — FP16. A precision with no fast path on a
type runs at its FP32 rate (cost/precision.py says so to the user). Kernels PyTorch runs
differently from what the capture counts — normalisation passes, depthwise and
channel-padded convolutions — follow cost/kernels.py.
"""

from __future__ import annotations

import numpy as np

from heterog.cost.host import autocast_casts, cudnn_calls, host_times_s
from heterog.cost.kernels import ConvKernels, bandwidth_kind, conv_kernels, traffic_factors
from heterog.cost.memory import TENSOR_CORE_KINDS, dtype_factors
from heterog.hardware.catalog import host_costs, host_overheads
from heterog.hardware.cpu_probe import measure_cpu
from heterog.hardware.efficiency import Curve, gpu_curve, memory_efficiency
from heterog.hardware.gputype import GpuType
from heterog.ir.kinds import HALF_PRECISIONS, Phase, Precision
from heterog.ir.opgraph import OpGraph

E_VECTOR = 0.5  # non-tensor-core FLOPs: element-wise math rarely beats half of peak
# Kernel efficiency relative to a square GEMM of the same work. Attention kernels pay for the
# softmax between their two products. cuDNN convolutions on tensor cores (TF32/BF16/FP16) reach
# far less of the tensor-core peak than GEMMs do; on CUDA cores (FP32) about as much. The
# convolution factors are calibrated on NVIDIA's published ResNet-50 v1.5 PyTorch training
# throughputs (DeepLearningExamples performance tables, approximately: A100-80GB TF32 ~1000
# img/s, AMP ~2500; V100-16GB FP32 ~390, AMP ~1200), after the memory-bound BN/ReLU time.
KIND_FACTOR_GPU = {"matmul": 1.0, "attention": 0.7}
CONV_FACTOR_GPU = {"fp32": 1.0, "tf32": 0.4, "bf16": 0.4, "fp16": 0.4}
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


def _matmul_precision(kind: str, precision: str, gpu: GpuType) -> str:
    """The catalog precision whose peak a tensor-core kernel of `kind` runs at: the plan's
    (GpuType.catalog_precision, fp32 where the type has no fast path for it), except that
    PyTorch runs fp32 convolutions on TF32 tensor cores by default (cudnn.allow_tf32 is on,
    cuda.matmul.allow_tf32 off)."""
    return gpu.catalog_precision("tf32" if precision == "fp32" and kind == "conv" else precision)


class TypeTable:
    """Per-node arrays for one GPU type, one precision, one phase: what the roofline needs."""

    def __init__(self, graph: OpGraph, gpu: GpuType, precision: str, phase: Phase):
        nodes = graph.nodes
        fw = phase == Phase.FORWARD
        conv = np.array([n.kind == "conv" for n in nodes])
        convs = conv_kernels(graph, _matmul_precision("conv", precision, gpu)) if gpu.vendor != "cpu" else None
        flops_fixed = np.array([(n.fwd_flops if fw else n.bwd_flops).fixed for n in nodes])
        flops_ps = np.array([(n.fwd_flops if fw else n.bwd_flops).per_sample for n in nodes])
        tc = np.array(
            [
                n.tensor_core_flops_fraction if n.kind in TENSOR_CORE_KINDS or n.tensor_core_flops_fraction > 0 else 0.0
                for n in nodes
            ]
        )
        if convs is not None:
            # depthwise convolutions on CUDA cores; channels padded to the tensor cores'
            # alignment (cost/kernels.py)
            tc = np.where(conv & ~convs.on_tensor_cores, 0.0, tc)
            flops_fixed = np.where(conv, flops_fixed * convs.flop_padding, flops_fixed)
            flops_ps = np.where(conv, flops_ps * convs.flop_padding, flops_ps)
        self._traffic(graph, gpu, precision, phase, conv, convs)
        self.tc_fixed, self.tc_ps = flops_fixed * tc, flops_ps * tc
        self.other_fixed, self.other_ps = flops_fixed * (1 - tc), flops_ps * (1 - tc)
        kernels = np.array([float(n.fwd_kernels if fw else n.bwd_kernels) for n in nodes])
        has_work = (flops_fixed + flops_ps + self.bytes_fixed + self.bytes_ps) > 0
        self.kernels = np.where((kernels == 0) & has_work, 1.0, kernels)
        if self.casts is not None:
            self.kernels = self.kernels + self.casts.count
        self._rates(graph, gpu, precision, phase, conv, convs)
        self._host(graph, gpu, precision, phase)

    def _traffic(
        self, graph: OpGraph, gpu: GpuType, precision: str, phase: Phase, conv: np.ndarray, convs: ConvKernels | None
    ) -> None:
        """Bytes each node moves (fixed and per sample), autocast's casts included, and the
        NHWC transforms of half-precision NCHW convolutions."""
        nodes = graph.nodes
        fw = phase == Phase.FORWARD
        # traffic in the dtype of what the node writes (reads are mostly of the same size);
        # CPU kernels on half tensors convert to fp32 and back, so they gain no speed there
        factor = dtype_factors(graph, precision).out if gpu.vendor != "cpu" else np.ones(len(nodes))
        if convs is not None:  # kernels that read their input more than once (cost/kernels.py)
            factor = factor * traffic_factors(graph, phase) * (1.0 if fw else convs.bwd_passes)
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
        if convs is not None and precision in HALF_PRECISIONS and gpu.vendor == "nvidia":
            act_ps = np.array([b.per_sample for b in bytes_obj]) * factor
            nchw_tc = conv & convs.on_tensor_cores & ~convs.nhwc
            self.transform_ps = np.where(nchw_tc, NCHW_HALF_CONV_TRANSFORM_PASSES * act_ps, 0.0)
        self.transform_bandwidth = gpu.memory_bandwidth_bytes_per_s * memory_efficiency(gpu)

    def _rates(
        self, graph: OpGraph, gpu: GpuType, precision: str, phase: Phase, conv: np.ndarray, convs: ConvKernels | None
    ) -> None:
        """Each node's peak and efficiency curve (one curve per precision used: conv may
        differ from matmul), its kind's compute factor, and its memory bandwidth."""
        nodes = graph.nodes
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
        if precision == Precision.AMP_BF16 and gpu.vendor != "cpu":
            bn = np.array([_is_batch_norm(n) for n in nodes])
            self.bandwidth = np.where(bn, self.bandwidth * NATIVE_BN_BF16_FACTOR, self.bandwidth)
        # bytes per element of the tensor-core operands, for the intensity-derived size
        self.element_bytes = 2.0 if precision in HALF_PRECISIONS else 4.0

    def _host(self, graph: OpGraph, gpu: GpuType, precision: str, phase: Phase) -> None:
        """What the host adds: dispatch and kernel gaps; on a GPU its time per node and
        cuDNN's plan look-ups; on a CPU fresh pages and per-element floors."""
        nodes = graph.nodes
        fw = phase == Phase.FORWARD
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
        assert self.host_s is not None and self.cudnn_s is not None  # set for every GPU table
        return np.maximum(roof + k * self.kernel_gap, self.host_s[idx] * host_scale + self.cudnn_s[idx])


def _is_batch_norm(node) -> bool:
    return node.kind == "norm" and "batchnorm" in node.module_type.lower()


def _kind_factor(kind: str, gpu: GpuType, precision: str) -> float:
    if gpu.vendor != "cpu":
        if kind == "conv":
            return CONV_FACTOR_GPU[precision]
        return KIND_FACTOR_GPU.get(kind, 1.0)
    if kind == "conv":
        p = measure_cpu(gpu.cpu_threads)
        # oneDNN convolutions vs the same work as GEMM, measured on this machine
        return float(np.clip(p.conv_flops_per_s / p.peak_flops_per_s, 0.25, 2.0))
    return 1.0 if kind == "matmul" else 0.8
