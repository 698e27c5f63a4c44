"""Single-process training on the same global batches: what every distributed run must equal."""

from __future__ import annotations

import torch

from heterog.execute.device import LossScaler, RankDevice
from heterog.ir.kinds import Precision
from heterog.ir.plan import Plan
from heterog.workload import build_model, global_batch, make_optimizer, resolve_workload, with_data


def reference_train(
    plan: Plan,
    *,
    steps: int,
    seed: int = 0,
    data: str | None = None,
    skip_steps: frozenset[int] = frozenset(),
    losses: list[float] | None = None,
    max_grad_norm: float | None = None,
) -> dict[str, torch.Tensor]:
    """Parameters after `steps` optimizer steps of the whole model on the whole batch, under
    the plan's precision (autocast on the CPU for amp-bf16 and fp16; fp16 with torch's own
    GradScaler at the executor's initial scale). `skip_steps`: fp16 steps to skip as an
    overflow would (no update, the scale halved). `losses`, when given, receives each step's
    global-batch loss (before that step's update), as a run reports them. `max_grad_norm`:
    gradients clipped to that global norm before each step (torch's clip_grad_norm_)."""
    torch.set_num_threads(1)
    work = with_data(resolve_workload(plan.model), data)
    model = build_model(work, seed=seed)
    opt = make_optimizer(list(model.parameters()), plan.optimizer)
    assert opt is not None, "the reference trains a model with parameters"
    fp16 = plan.precision == Precision.FP16
    scaler = torch.amp.GradScaler("cpu", init_scale=LossScaler(RankDevice(kind="cpu")).scale) if fp16 else None
    for step in range(steps):
        inputs, targets = global_batch(work, plan.batch_size, seed=seed, step=step)
        opt.zero_grad(set_to_none=True)
        with RankDevice(kind="cpu").autocast(plan.precision):  # as the ranks run it
            loss = work.loss(model(*inputs), targets)
        if losses is not None:
            losses.append(float(loss.detach().float()))
        if scaler is None:
            loss.float().backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
        elif step in skip_steps:
            scaler.update(scaler.get_scale() * 0.5)
        else:
            scaler.scale(loss.float()).backward()
            if max_grad_norm is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            scaler.step(opt)
            scaler.update()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
