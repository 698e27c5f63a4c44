"""The reference layer that the peer per-layer data ran (cost/peer_layer.py): its capture must
move the bytes that Megatron-LM's kernels move, since the per-type fits and their scores in
benchmarks/predict_gpu.py rest on it."""

from __future__ import annotations

from pathlib import Path

import pytest

import heterog.cost
from heterog.capture import capture_model

SPEC = str(Path(heterog.cost.__file__).parent / "peer_layer.py") + ":megatron_gpt_layer"
HIDDEN, HEADS, SEQ = 256, 4, 128
SCORES_BYTES = HEADS * SEQ * SEQ * 4  # one fp32 s×s score matrix per sample


def _nodes(fused: bool) -> dict:
    g = capture_model(
        SPEC, {"hidden": HIDDEN, "heads": HEADS, "positions": SEQ, "fused_softmax": fused}, batch_size=1, seq_len=SEQ
    )
    return {n.module_path.removeprefix("layers.0."): n for n in g.nodes if n.module_path.startswith("layers.0")}


@pytest.fixture(scope="module")
def fused():
    return _nodes(True)


@pytest.fixture(scope="module")
def fallback():
    return _nodes(False)


def test_every_profiled_op_is_its_own_node(fused):
    for op in (
        "ln_1",
        "qkv",
        "score",
        "softmax",
        "attn_dropout",
        "context",
        "dense",
        "attn_residual",
        "ln_2",
        "fc_1",
        "gelu",
        "fc_2",
        "mlp_residual",
    ):
        assert op in fused, f"{op} is not a node of its own: its roofline would be merged with another op's"


def test_fused_softmax_reads_and_writes_the_scores_once(fused):
    assert fused["softmax"].fwd_bytes.per_sample == pytest.approx(2 * SCORES_BYTES, rel=0.01)


def test_fp32_softmax_falls_back_to_three_passes(fused, fallback):
    # Megatron's torch fallback: scale, masked_fill, softmax (plus the mask): ≥ 3 reads+writes
    ratio = fallback["softmax"].fwd_bytes.per_sample / fused["softmax"].fwd_bytes.per_sample
    assert 2.9 <= ratio <= 3.5


def test_dropout_is_one_kernel_with_a_byte_mask(fused):
    # aten.native_dropout as on CUDA: read the input, write the output and a bool mask
    assert fused["attn_dropout"].fwd_bytes.per_sample == pytest.approx(2.25 * SCORES_BYTES, rel=0.01)
    assert fused["attn_dropout"].fwd_kernels == 1


def test_gelu_is_one_kernel(fused):
    n = fused["gelu"]
    assert n.fwd_kernels == 1
    assert n.fwd_bytes.per_sample == pytest.approx(2 * SEQ * 4 * HIDDEN * 4, rel=0.01)
