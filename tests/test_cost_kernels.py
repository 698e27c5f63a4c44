"""Kernels as PyTorch runs them on a GPU (cost/kernels.py): normalisation passes, and the
convolution algorithm picked from the geometry the capture records."""

from __future__ import annotations

import pytest
import torch
from cost_support import conv_graph
from torch import nn

from heterog.capture.capture import capture
from heterog.cost.kernels import conv_kernels, norm_passes
from heterog.ir.kinds import Phase


class _Blocks(nn.Module):
    """A 3-channel stem, a depthwise 3×3 and a pointwise 1×1 (MobileNet's block)."""

    def __init__(self, channels_last: bool = False):
        super().__init__()
        self.channels_last = channels_last
        self.stem = nn.Conv2d(3, 64, 3, stride=2, padding=1, bias=False)
        self.dw = nn.Conv2d(64, 64, 3, padding=1, groups=64, bias=False)
        self.pw = nn.Conv2d(64, 128, 1, bias=False)

    def forward(self, x):
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.pw(torch.relu(self.dw(torch.relu(self.stem(x))))).mean(dim=(2, 3))


def _graph(channels_last: bool = False):
    return capture(
        _Blocks(channels_last),
        (torch.randn(2, 3, 64, 64),),
        targets=torch.randn(2, 128),
        loss_fn=nn.functional.mse_loss,
    )


def test_the_capture_records_each_convolutions_geometry():
    shapes = _graph().meta["conv"]
    assert shapes["stem"] == {
        "kernel": [3, 3],
        "in_channels": 3,
        "out_channels": 64,
        "groups": 1,
        "stride": 2,
        "channels_last": False,
    }
    assert shapes["dw"]["groups"] == 64 and shapes["pw"]["kernel"] == [1, 1]
    assert _graph(channels_last=True).meta["conv"]["dw"]["channels_last"]


def test_the_algorithm_follows_the_geometry():
    g = _graph()
    index = {n.name: i for i, n in enumerate(g.nodes)}
    bf16, fp16 = conv_kernels(g, "bf16"), conv_kernels(g, "fp16")
    stem, dw, pw = index["stem"], index["dw"], index["pw"]
    # the stem's 3 channels padded to the tensor cores' 8 in half precision, 4 in TF32
    assert bf16.flop_padding[stem] == pytest.approx(8 / 3) and conv_kernels(g, "tf32").flop_padding[stem] == 4 / 3
    assert bf16.flop_padding[pw] == 1.0
    # depthwise: CUDA cores; bf16 NCHW runs PyTorch's kernels (no cuDNN call, weight gradient
    # re-read per tap), fp16 with ≥ 32 channels runs cuDNN's
    assert not bf16.on_tensor_cores[dw] and bf16.on_tensor_cores[pw]
    assert not bf16.cudnn[dw] and bf16.bwd_passes[dw] > 2 and fp16.cudnn[dw] and fp16.bwd_passes[dw] == 1
    convs = [stem, dw, pw]
    assert not bf16.nhwc[convs].any()
    nhwc = _graph(channels_last=True)
    assert conv_kernels(nhwc, "bf16").nhwc[[i for i, n in enumerate(nhwc.nodes) if n.kind == "conv"]].all()


def test_channels_last_half_precision_convolutions_skip_the_transposes():
    """Same convolutions, fp16: the NCHW ones pay cuDNN's transposes in and out of NHWC."""
    from heterog.cost.analytic import AnalyticCostModel
    from heterog.cost.predict import single_device_cluster
    from heterog.hardware.catalog import get_gpu

    for device in ("H200", "T4"):
        cluster = single_device_cluster(get_gpu(device))
        t = {}
        for g in (_graph(), _graph(channels_last=True)):
            m = AnalyticCostModel(g, cluster, precision="fp16")
            convs = [n.name for n in g.nodes if n.kind == "conv"]
            t[g.meta["conv"]["stem"]["channels_last"]] = sum(
                m.group_time_s(convs, "local/gpu0", 4096, p) for p in Phase
            )
        assert t[True] < 0.9 * t[False], device


def test_a_graph_without_geometry_is_costed_as_dense_nchw_convolutions():
    g = conv_graph()
    assert "conv" not in g.meta
    k = conv_kernels(g, "bf16")
    assert k.on_tensor_cores[0] and k.cudnn[0] and k.flop_padding[0] == 1.0 and not k.nhwc[0]


def test_normalisation_passes_from_the_kernels():
    assert norm_passes("BatchNorm2d", Phase.FORWARD) == 1.5 and norm_passes(
        "BatchNorm2d", Phase.BACKWARD
    ) == pytest.approx(5 / 3)
    assert norm_passes("LayerNorm", Phase.FORWARD) == 1.0 and norm_passes("LayerNorm", Phase.BACKWARD) == pytest.approx(
        5 / 3
    )
    assert norm_passes("Dropout", Phase.BACKWARD) == 1.0
