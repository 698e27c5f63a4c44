"""Single-process training on the same global batches: what every distributed run must equal."""

from __future__ import annotations

import torch

from heterog.execute.device import RankDevice
from heterog.execute.workload import build_model, global_batch, make_optimizer, resolve_workload, with_data
from heterog.ir.plan import Plan


def reference_train(plan: Plan, *, steps: int, seed: int = 0, data: str | None = None) -> dict[str, torch.Tensor]:
    """Parameters after `steps` optimizer steps of the whole model on the whole batch, under
    the plan's precision (autocast on the CPU for amp-bf16)."""
    torch.set_num_threads(1)
    work = with_data(resolve_workload(plan.model), data)
    model = build_model(work, seed=seed)
    opt = make_optimizer(list(model.parameters()), plan.optimizer)
    for step in range(steps):
        inputs, targets = global_batch(work, plan.batch_size, seed=seed, step=step)
        opt.zero_grad(set_to_none=True)
        with RankDevice(kind="cpu").autocast(plan.precision):   # as the ranks run it
            loss = work.loss(model(*inputs), targets)
        loss.float().backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
