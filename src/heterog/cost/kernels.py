"""How the GPU kernels PyTorch picks for an op move memory, beyond what the capture counts.

The capture counts an op's bytes as its inputs plus its outputs, once. Some GPU kernels read
their input more than once by construction; the counts here come from the kernels' public
source, not from a fit, and apply on GPUs only (the `cpu` type measures its own kinds).

Normalisation (ATen/native/cuda/Normalization.cuh, layer_norm_kernel.cu; cuDNN's batch norm
in its non-persistent spatial mode, which PyTorch uses for NCHW tensors):
- batch norm / group norm, forward: a statistics pass over the input, then a pass that reads
  it again and writes the output — 3 passes where the capture counts 2;
- their backward: a reduction pass over the output gradient and the input, then a pass that
  reads both again and writes the input gradient — 5 where the capture counts 3;
- layer norm, forward: one kernel, each row read once into registers — as counted (2);
- its backward: the input-gradient kernel (3 passes) and a separate weight/bias-gradient
  reduction that reads the output gradient and the input again (2) — 5 where the capture
  counts 3.
A batch or group norm pass streams an NCHW tensor plane by plane with a reduction per
channel; a layer norm reads one row per thread block. They reach different bandwidths (the
H200 profile of resnet50, batch 128, fp32, puts cuDNN's batch norm passes at ~0.55-0.65 of a
copy's; the transformers' layer norms fit near a copy's), so batch and group norm have their
own kind, "batchnorm" (`bandwidth_kind`); a type that was never fitted on a CNN charges
it at the element-wise kind's bandwidth, the nearest kernel shape (hardware/efficiency.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from heterog.ir.kinds import Phase
from heterog.ir.opgraph import OpGraph

# (forward, backward) passes over the activations relative to the capture's count, by the
# module type's name (lower case, substring)
NORM_PASSES = {"batchnorm": (3 / 2, 5 / 3), "groupnorm": (3 / 2, 5 / 3), "layernorm": (1.0, 5 / 3)}


def norm_passes(module_type: str, phase: Phase) -> float:
    name = module_type.lower()
    for key, (fwd, bwd) in NORM_PASSES.items():
        if key in name:
            return fwd if phase == Phase.FORWARD else bwd
    return 1.0


def bandwidth_kind(node) -> str:
    """The kind whose sustained bandwidth a node's kernels reach (memory_efficiency)."""
    name = node.module_type.lower()
    if node.kind == "norm" and ("batchnorm" in name or "groupnorm" in name):
        return "batchnorm"
    return node.kind


def traffic_factors(graph: OpGraph, phase: Phase) -> np.ndarray:
    """Per node: the GPU kernels' memory traffic over the capture's count (1 for most)."""
    return np.array([norm_passes(n.module_type, phase) if n.kind == "norm" else 1.0 for n in graph.nodes])


# -- convolutions: which algorithm runs, from the geometry the capture records ------------------
#
# cuDNN runs a dense convolution as an implicit GEMM on tensor cores; its half-precision and
# TF32 kernels need channel counts aligned to 8 (fp16/bf16) or 4 (tf32) and pad the others
# (NVIDIA Deep Learning Performance guide, "Convolutional Layers User's Guide": channel
# alignment for Tensor Cores) — a first layer with 3 input channels does 8/3 of its FLOPs in
# half precision. Its tensor-core kernels are NHWC: NCHW inputs in half precision are
# transposed in and out (cost/roofline.py NCHW_HALF_CONV_TRANSFORM_PASSES); channels-last
# inputs are not.
# A depthwise convolution (one input channel per group) has no GEMM to give tensor cores: it
# runs as a direct kernel on the CUDA cores, memory-bound. PyTorch hands it to cuDNN only for
# channels-last inputs, or fp16 NCHW inputs of at least 32 channels; fp32 and bf16 NCHW run
# PyTorch's own kernels (ATen/native/Convolution.cpp `use_cudnn_depthwise`), whose
# weight-gradient kernel gives each (channel, tap) its own thread block, each reading the
# channel's input and output gradient again (ATen/native/cuda/DepthwiseConv2d.cu): k² reads,
# all but the first served by L2 when the channel's blocks run together.
DEPTHWISE_CUDNN_MIN_CHANNELS = 32
# L2 over DRAM bandwidth: Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
# Microbenchmarking" (arXiv 1804.06826): V100 L2 ~2.2 TB/s against ~0.75 TB/s from HBM2
L2_OVER_DRAM = 3.0
CHANNEL_ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4}


def _aligned(channels: int, to: int) -> float:
    return float(-(-channels // to) * to) / channels


def depthwise(geometry: dict) -> bool:
    return geometry["groups"] > 1 and geometry["in_channels"] // geometry["groups"] == 1


def native_depthwise(geometry: dict, precision: str) -> bool:
    """A depthwise convolution that runs PyTorch's own CUDA kernels rather than cuDNN."""
    return (
        depthwise(geometry)
        and not geometry["channels_last"]
        and not (precision == "fp16" and geometry["in_channels"] >= DEPTHWISE_CUDNN_MIN_CHANNELS)
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvKernels:
    """Per node (arrays over the graph; non-convolutions hold the neutral value)."""

    on_tensor_cores: np.ndarray  # False: a direct kernel on CUDA cores (depthwise)
    flop_padding: np.ndarray  # ≥ 1: channels padded to the tensor cores' alignment
    nhwc: np.ndarray  # its tensor-core kernels read the input as it is (no transposes)
    cudnn: np.ndarray  # runs through cuDNN (its host pays a cuDNN call)
    bwd_passes: np.ndarray  # backward traffic over the capture's count


def conv_kernels(graph: OpGraph, mm_precision: str) -> ConvKernels:
    """How each convolution of `graph` runs at the catalog precision its tensor-core
    kernels use (`mm_precision`: tf32/fp16/bf16, or fp32 on CUDA cores)."""
    n = len(graph.nodes)
    tc, pad, nhwc = np.zeros(n, bool), np.ones(n), np.zeros(n, bool)
    cudnn, bwd = np.zeros(n, bool), np.ones(n)
    shapes = graph.meta.get("conv") or {}
    align = CHANNEL_ALIGNMENT.get(mm_precision)
    for i, node in enumerate(graph.nodes):
        if node.kind != "conv":
            continue
        g = shapes.get(node.name)
        tc[i], cudnn[i] = True, True
        if g is None:  # a graph captured without geometry: a dense NCHW conv
            continue
        nhwc[i] = bool(g["channels_last"])
        if depthwise(g):
            tc[i] = False
            if native_depthwise(g, mm_precision):
                cudnn[i] = False
                taps = float(np.prod(g["kernel"]))
                # the weight gradient re-reads input and output gradient (2 of the 3 tensors
                # the backward is counted with) once per extra tap, from L2
                bwd[i] = 1.0 + (taps - 1.0) * (2.0 / 3.0) / L2_OVER_DRAM
        elif align is not None:
            pad[i] = _aligned(g["in_channels"] // g["groups"], align) * _aligned(g["out_channels"], align)
    return ConvKernels(on_tensor_cores=tc, flop_padding=pad, nhwc=nhwc, cudnn=cudnn, bwd_passes=bwd)
