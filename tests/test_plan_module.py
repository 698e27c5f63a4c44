"""heterog.plan of an in-memory nn.Module: planned like a named model; running it says why
it cannot, before any rank starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import heterog
from heterog.errors import HeterogError, ModelError
from heterog.ir.plan import Plan


def test_plan_an_in_memory_module():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(12, 16), torch.randint(0, 4, (12,))
    result = heterog.plan(
        module,
        example_inputs=(x,),
        targets=y,
        loss_fn=nn.functional.cross_entropy,
        cluster="emulated-4",
        budget_s=2,
        policy=False,
        max_iters=5,
        name="mlp16",
    )
    best = Plan.from_dict(result["best"])
    assert best.model.name == "in-memory:mlp16" and best.batch_size == 12
    assert best.predicted_iteration_time_s > 0 and result["candidates"]
    with pytest.raises(HeterogError, match="in-memory nn.Module"):
        heterog.run(best, steps=2)


def test_plan_by_name_still_works_and_modules_need_inputs():
    result = heterog.plan("mlp", batch_size=8, cluster="emulated-4", budget_s=2, policy=False, max_iters=3)
    assert Plan.from_dict(result["best"]).model.name == "mlp"
    with pytest.raises(ModelError, match="example_inputs"):
        heterog.plan(nn.Linear(2, 2), cluster="emulated-4")


def test_example_batch_receives_the_model_arguments(tmp_path):
    from heterog.capture import capture_model

    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def net(in_features=16, classes=4):\n"
        "    return nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, classes))\n"
        "def example_batch(batch_size, seq_len=None, in_features=16):\n"
        "    return (torch.randn(batch_size, in_features),), torch.randint(0, 4, (batch_size,))\n"
    )
    graph = capture_model(f"{tmp_path}/net.py:net", {"in_features": 7}, batch_size=4)
    assert graph.num_parameters == 7 * 32 + 32 + 32 * 4 + 4
