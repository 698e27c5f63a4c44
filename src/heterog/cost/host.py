"""The host side of an eager PyTorch step on a GPU, and the casts autocast adds.

Eager PyTorch is two processors in series: the host (Python, the dispatcher, the autograd
engine, autocast) issues each op, the GPU runs it. The host runs ahead while the GPU is busy;
the GPU idles while the host is behind. So a step costs, op by op, whichever is longer — at
small batches the host's (resnet50 takes 16–25 ms per step on an H200 from batch 1 to 32 in
cost/data/h200_steps.json: the host's dispatch, not the GPU's math). cost.roofline charges
every node max(device time, host time), which also keeps a step from ever being faster than
its host time.

Host time of a node (hardware.gputype.HostCosts, fitted on the H200 steps):
  forward  = forward_node_s + forward_op_s · (ops − 1) + autocast_cast_s · casts + cudnn_op_s · cudnn
             (a leaf module's node; a loose op, run by its container's forward with no module
              call of its own, pays forward_op_s · ops)
  backward = backward_op_s · ops + autocast_cast_s · casts + cudnn_op_s · cudnn

cuDNN calls (`cudnn_calls`): an op that runs through cuDNN's frontend API costs the host far
more than an ordinary op — it builds a key for the operation graph and looks up (or builds)
an execution plan before launching. In the H200 per-op profiles (cost/data/h200_steps.json,
op_profiles, host time per call less the median leaf op's) a cuDNN convolution costs ~67 µs
more in forward and ~113 µs more in backward (resnet50), a cuDNN attention ~97 and ~67 µs
more (gpt2-medium, bf16): the same ~80–90 µs per call in two unrelated models, so it is one
figure of the host software, not of a model. It is why resnet50's small-batch steps cost the
host 16–25 ms although it has fewer ops than a transformer. Which nodes call cuDNN: every
convolution on an NVIDIA GPU but the depthwise ones PyTorch runs with its own kernels
(cost/kernels.py); attention in half precision on Hopper, where PyTorch's
scaled_dot_product_attention picks its cuDNN backend (the gpt2-medium bf16 profile shows
`_cudnn_attention_forward`; in fp32 it ran `_efficient_attention_forward`, not cuDNN).

A node's `host_speed` (cluster YAML) scales every host cost but this one. The reason is in
the data, and it is a hypothesis: between the two H200 measurement sessions the same steps'
host time grew by ~1.6× for bert-large (mostly Python-level module and dispatcher work) but
only ~1.36× for resnet50 (about half of it cuDNN calls); a slowdown of the framework's own
work that spares cuDNN's C++ plan look-ups fits both. A node whose CPU is uniformly slower
would slow these too, so on such a node the model is slightly optimistic for convolutions.

Autocast (torch.amp autocast_mode.cpp, its lower-precision op list): matmul, convolution and
attention run in half precision, so autocast casts their fp32 weights (cached within a
forward) and fp32 inputs to half — one cast kernel each, 4 B read and 2 B written per
element; in backward the gradients of those casts are cast back (2 B read, 4 B written).
Inputs already in half (the output of another half op) need no cast. An op on autocast's
fp32 list (layer norm, losses, pow) casts its half inputs up, one cast each (gpt2-medium's
bf16 profile: 777 `aten::to` calls a step; the matmul-side casts alone are 628 of the
model's, with these 678). A cast's host cost (`autocast_cast_s`) is measured on that
profile, not fitted: 18.1 µs per `aten::to`, children included (cost.calibrate.cast_op_host_s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from heterog.cost.kernels import conv_kernels
from heterog.cost.memory import TENSOR_CORE_KINDS, dtype_factors, forced_fp32
from heterog.hardware.gputype import GpuType, HostCosts, TensorCores
from heterog.ir.kinds import HALF_PRECISIONS, Phase
from heterog.ir.opgraph import OpGraph

CAST_BYTES_PER_FP32_BYTE = 1.5  # a 4-byte element read and a 2-byte one written, per 4 bytes


@dataclass(frozen=True, slots=True)
class Casts:
    """Per node: the casts autocast adds to its forward (and, mirrored, to its backward) and
    the bytes they move (an affine function of the batch)."""

    count: np.ndarray
    bytes_fixed: np.ndarray
    bytes_per_sample: np.ndarray


def autocast_casts(graph: OpGraph, precision: str) -> Casts | None:
    """The casts autocast inserts under amp-bf16/fp16 (before half ops: fp32 weights and
    inputs; before fp32-list ops: half inputs); None in fp32/tf32 (no autocast)."""
    if precision not in HALF_PRECISIONS:
        return None
    n = len(graph.nodes)
    out = dtype_factors(graph, precision).out
    gi = graph.index
    fp32_in_fixed, fp32_in_ps, fp32_inputs = np.zeros(n), np.zeros(n), np.zeros(n)
    half_in_fixed, half_in_ps, half_inputs = np.zeros(n), np.zeros(n), np.zeros(n)
    for e in graph.edges:
        j = gi[e.dst]
        if out[gi[e.src]] == 1.0:
            fp32_in_fixed[j] += e.bytes.fixed
            fp32_in_ps[j] += e.bytes.per_sample
            fp32_inputs[j] += 1
        else:
            half_in_fixed[j] += e.bytes.fixed
            half_in_ps[j] += e.bytes.per_sample
            half_inputs[j] += 1
    preds = graph.predecessors
    count, fixed, per_sample = np.zeros(n), np.zeros(n), np.zeros(n)
    for i, node in enumerate(graph.nodes):
        if forced_fp32(node):
            # an op on autocast's fp32 list casts each half input up (2 B read, 4 B written
            # per element; the edge's bytes are fp32 bytes): gpt2-medium's `pow` and loss
            count[i] = half_inputs[i]
            fixed[i] = CAST_BYTES_PER_FP32_BYTE * half_in_fixed[i]
            per_sample[i] = CAST_BYTES_PER_FP32_BYTE * half_in_ps[i]
            continue
        if node.kind not in TENSOR_CORE_KINDS:
            continue
        weight_bytes = max(float(node.param_bytes), float(node.fwd_bytes.fixed))
        weights = len(node.param_names) or (1 if weight_bytes > 0 else 0)
        if not preds[node.name]:  # reads the graph input, an fp32 batch
            fp32_inputs[i] = 1
            fp32_in_ps[i] = float(graph.input_bytes.per_sample)
        count[i] = weights + fp32_inputs[i]
        fixed[i] = CAST_BYTES_PER_FP32_BYTE * (weight_bytes + fp32_in_fixed[i])
        per_sample[i] = CAST_BYTES_PER_FP32_BYTE * fp32_in_ps[i]
    return Casts(count=count, bytes_fixed=fixed, bytes_per_sample=per_sample)


# Tensor-core generations whose PyTorch attention in half precision runs through cuDNN: the
# H200's bf16 profile (PyTorch 2.11) runs `_cudnn_attention_forward`; Blackwell is assumed to
# take the same SDPA backend (not measured)
CUDNN_ATTENTION_GENERATIONS = frozenset({TensorCores.HOPPER, TensorCores.BLACKWELL})


def cudnn_calls(graph: OpGraph, precision: str, gpu: GpuType) -> np.ndarray:
    """Per node: cuDNN frontend calls in its forward (and, one each, in its backward)."""
    if gpu.vendor != "nvidia":
        return np.zeros(len(graph.nodes))
    half = precision in HALF_PRECISIONS
    hopper = gpu.public is not None and gpu.public.tensor_cores in CUDNN_ATTENTION_GENERATIONS
    # every convolution but a depthwise one that PyTorch runs with its own kernels
    conv = conv_kernels(graph, gpu.catalog_precision("tf32" if precision == "fp32" else precision)).cudnn
    return np.array(
        [1.0 if c or (n.kind == "attention" and half and hopper) else 0.0 for n, c in zip(graph.nodes, conv)]
    )


def host_times_s(
    graph: OpGraph, host: HostCosts, phase: Phase, casts: Casts | None, cudnn: np.ndarray | None = None
) -> np.ndarray:
    """Host time of every node's forward or backward (seconds), batch-independent."""
    nodes = graph.nodes
    if phase == Phase.FORWARD:
        ops = np.array([float(n.fwd_kernels) for n in nodes])
        # a leaf module's call (nn.Module.__call__, hooks) and first op; a loose op runs in its
        # container's forward, with no module call of its own (the capture names it 'path::op@k')
        leaf = np.array(["::" not in n.name for n in nodes])
        first = np.where(leaf, host.forward_node_s, host.forward_op_s)
        t = np.where(ops > 0, first + host.forward_op_s * np.maximum(ops - 1, 0), 0.0)
    else:
        ops = np.array([float(n.bwd_kernels) for n in nodes])
        t = host.backward_op_s * ops
    if casts is not None:
        t = t + host.autocast_cast_s * casts.count
    if cudnn is not None:
        t = t + host.cudnn_op_s * cudnn
    return t
