"""The kinds every stage shares, each defined once. StrEnum members compare equal to their
strings, so artifacts keep plain strings in JSON and code compares with the members."""

from __future__ import annotations

from enum import IntEnum, StrEnum


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


class ShardStage(IntEnum):
    """What a replicated group shards across its replicas (ZeRO, Rajbhandari et al., SC'20):
    each stage shards what the one before it does, and more."""

    NONE = 0  # every replica holds all its state
    OPTIMIZER = 1  # ZeRO-1: optimizer state
    GRADIENTS = 2  # ZeRO-2: + gradients (reduce-scattered)
    PARAMETERS = 3  # ZeRO-3 / FSDP: + parameters (all-gathered for each use, freed after)


class CollectiveOp(StrEnum):
    """What a collective computes. Members hold contiguous, possibly uneven pieces of a flat
    buffer, in ring order, for the two halves of an all-reduce."""

    ALL_REDUCE = "all-reduce"  # every member gets the sum of the whole buffer
    REDUCE_SCATTER = "reduce-scatter"  # each member gets the sum of its own piece
    ALL_GATHER = "all-gather"  # every member gets every member's piece


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
