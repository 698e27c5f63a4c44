"""The kinds every stage shares, each defined once. StrEnum members compare equal to their
strings, so artifacts keep plain strings in JSON and code compares with the members."""

from __future__ import annotations

from enum import StrEnum


class Precision(StrEnum):
    FP32 = "fp32"
    TF32 = "tf32"  # fp32 tensors, matmuls and convolutions on TF32 tensor cores
    # (torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 on)
    AMP_BF16 = "amp-bf16"  # autocast to bfloat16, fp32 master weights
    FP16 = "fp16"  # autocast to float16, fp32 master weights, gradient scaler


# the precisions that autocast compute to 16 bits, keeping fp32 master weights
HALF_PRECISIONS = frozenset({Precision.AMP_BF16, Precision.FP16})
# the catalog precision (the peak rate of hardware/catalog.yaml: fp32, tf32, fp16, bf16)
# whose tensor-core kernels a plan precision runs, where a GPU type has that rate
CATALOG_PRECISION: dict[str, str] = {
    Precision.FP32: "fp32",
    Precision.TF32: "tf32",
    Precision.AMP_BF16: "bf16",
    Precision.FP16: "fp16",
}


class SyncMethod(StrEnum):
    """How the gradients of a replicated group are combined."""

    NONE = "none"
    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"
    PS = "ps"


class PipelineSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"  # of a recomputing block: runs its forward again first


class InstructionKind(StrEnum):
    COMPUTE = "compute"
    SEND = "send"
    RECV = "recv"
    COLLECTIVE = "collective"
    OPTIMIZER = "optimizer"


class Objective(StrEnum):
    """What the planner minimises (search/objective.py)."""

    TIME = "time"  # the iteration time
    COST = "cost"  # the price per sample: the used devices' price per hour × iteration time / batch
