"""The user's training options under every plan equal a plain single-process PyTorch loop.

AdamW (lr 3e-4, weight decay 0.1, betas (0.9, 0.95)), a cosine schedule after one warm-up
step, gradients clipped to a global norm of 1.0 and 2 batches accumulated per optimizer
step, on small GPT-2 and Llama configurations under even data parallelism, a 1F1B pipeline,
parameter servers (one on a device without a replica) and an uneven hybrid: after 3 steps
every rank's parameters equal those of a loop written here with torch's own classes
(AdamW, SequentialLR of LinearLR and CosineAnnealingLR, clip_grad_norm_), within 1e-5
relative (`close` says which rounding-level elements may differ), with the same learning
rates and gradient norms. Real gloo processes; the 8 plans run in one launch
(tests/plan_batch.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from plan_batch import BatchedRun, batch_options

from heterog.capture import capture_model
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Limits
from heterog.ir.training_config import TrainingConfig
from heterog.workload import build_model, global_batch, resolve_workload

STEPS = 3
SEQ = 8
ACCUMULATE = 2
WARMUP = 1
MAX_NORM = 1.0
ADAMW = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
TRAINING = TrainingConfig(
    lr=ADAMW["lr"],
    weight_decay=ADAMW["weight_decay"],
    betas=ADAMW["betas"],
    lr_schedule="cosine",
    warmup_steps=WARMUP,
    max_grad_norm=MAX_NORM,
    accumulate=ACCUMULATE,
)
BATCH_RUN = batch_options(steps=STEPS, limits=Limits(timeout_s=120), training=TRAINING)
MODELS = {
    "gpt2": dict(hidden=32, layers=2, heads=4, vocab=96, positions=32, dropout=0.0),
    "llama": dict(hidden=48, layers=2, heads=4, kv_heads=2, ffn=64, vocab=96, positions=32),
}


@functools.cache
def _halves(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    nodes = tuple(n.name for n in capture_model(name, MODELS[name], batch_size=2, seq_len=SEQ).nodes)
    k = len(nodes) // 2
    return nodes[:k], nodes[k:]


def _reps(*pairs) -> tuple[Replica, ...]:
    return tuple(Replica(device=d, share=s) for d, s in pairs)


def _plan(name: str, groups: list[Group], *, batch_size: int = 6, microbatches: int = 1, schedule="gpipe") -> Plan:
    return Plan(
        strategy="test",
        model=ModelSpec(name=name, args=MODELS[name], batch_size=batch_size, seq_len=SEQ),
        groups=tuple(groups),
        num_microbatches=microbatches,
        schedule=schedule,
        optimizer="adamw",
    ).validate()


def plans(name: str) -> list[Plan]:
    """Even DP, a 1F1B pipeline, parameter servers and an uneven hybrid of model `name`."""
    first, second = _halves(name)
    everything = first + second
    return [
        _plan(name, [Group(name="all", nodes=everything, replicas=_reps(("a", 0.5), ("b", 0.5)), sync="ring")]),
        _plan(
            name,
            [
                Group(name="s0", nodes=first, replicas=_reps(("a", 1.0))),
                Group(name="s1", nodes=second, replicas=_reps(("b", 1.0))),
            ],
            microbatches=2,
            schedule="1f1b",
        ),
        _plan(
            name,
            [
                Group(name="front", nodes=first, replicas=_reps(("a", 0.5), ("b", 0.5)), sync="ps", ps_device="c"),
                Group(name="back", nodes=second, replicas=_reps(("a", 0.25), ("b", 0.75)), sync="ps", ps_device="b"),
            ],
            batch_size=8,
        ),
        _plan(
            name,
            [
                Group(name="front", nodes=first, replicas=_reps(("a", 0.6), ("b", 0.4)), sync="ring"),
                Group(name="back", nodes=second, replicas=_reps(("c", 0.7), ("a", 0.3)), sync="tree"),
            ],
            batch_size=7,
        ),
    ]


def close(value: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 1e-5 relative to the parameter's norm. Two kinds of elements are pure rounding
    noise and are allowed apart: GPT-2's attention key biases (a gradient of exactly 0 in
    exact arithmetic, as softmax ignores a common shift) stay within 1e-6 of each other around
    0; and AdamW divides a gradient by its own size, so an element whose gradient is at
    rounding level (~1e-9) moves by a noisy fraction of lr — at most one element in a
    thousand, by at most lr per step."""
    diff = (value - want).abs()
    if (value - want).norm() <= 1e-5 * want.norm() or diff.max() <= 1e-6:
        return True
    return int((diff > 1e-6).sum()) <= max(1, diff.numel() // 1000) and float(diff.max()) <= STEPS * ADAMW["lr"]


def describe(value: torch.Tensor, want: torch.Tensor) -> str:
    diff = (value - want).abs()
    rel = ((value - want).norm() / want.norm().clamp_min(1e-12)).item()
    return f"relative {rel:.2e}, largest {diff.max().item():.2e}, {int((diff > 1e-6).sum())} element(s) > 1e-6"


PLAN_NAMES = ["even-dp", "1f1b", "parameter-servers", "uneven-hybrid"]


def torch_loop(plan: Plan) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The single-process loop with torch's own classes: (parameters, learning rates, norms)."""
    torch.set_num_threads(1)
    work = resolve_workload(plan.model)
    model = build_model(work, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / (WARMUP + 1), total_iters=WARMUP),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - WARMUP),
        ],
        milestones=[WARMUP],
    )
    lrs, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for j in range(ACCUMULATE):
            inputs, targets = global_batch(work, plan.batch_size, seed=0, step=step * ACCUMULATE + j)
            (work.loss(model(*inputs), targets) / ACCUMULATE).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, lrs, norms


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.batched(plan=plans)
@pytest.mark.parametrize("name", list(MODELS))
def test_adamw_cosine_clipping_and_accumulation_equal_a_torch_loop_under_every_plan(plan_batch, name):
    runs: list[BatchedRun] = plan_batch.get_all(plans, name=name)
    for label, done in zip(PLAN_NAMES, runs):
        want, lrs, norms = torch_loop(done.plan)  # per plan: their global batches differ
        assert max(norms) > MAX_NORM, f"the clip never engaged (norms {norms}): the test would not test it"
        out = done.result()
        assert out.learning_rates is not None and list(out.learning_rates) == pytest.approx(lrs, rel=1e-12), label
        assert out.grad_norms is not None and list(out.grad_norms) == pytest.approx(norms, rel=1e-5), label
        assert out.training is not None
        assert out.training["optimizer"] == "AdamW" and out.training["max_grad_norm"] == MAX_NORM
        seen = set()
        for rank in range(len(out.devices)):
            for pname, value in torch.load(done.out_dir / f"params_rank{rank}.pt").items():
                assert close(value, want[pname]), f"{label} rank {rank} {pname}: {describe(value, want[pname])}"
                seen.add(pname)
        assert seen == set(want), f"{label}: parameters held by no rank: {set(want) - seen}"
