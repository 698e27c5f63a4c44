"""fp16 training under every sync method equals single-process fp16 training with a loss scaler.

CPU autocast runs fp16 as a GPU's does: the loss is scaled (65536), gradients are unscaled
after the sync, and a step in which any gradient overflowed is skipped on every rank with the
scale halved (device.LossScaler; torch.amp.GradScaler in the reference). A parameter server
unscales the gradient sum it gathered and applies its update only once every rank has agreed
the step is clean. GPT-2 (small), 3 steps, real gloo processes, in one launch.
"""

from __future__ import annotations

import pytest
import torch

from heterog.capture import capture_model
from heterog.execute.reference import reference_train
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Fault, FaultKind, Limits, OutputConfig, PredictionConfig, RunOptions
from heterog.runs import run_many

STEPS = 3
SEQ = 8
ARGS = dict(hidden=32, layers=2, heads=4, vocab=96, positions=32, dropout=0.0)
OVERFLOW_STEP = 1


def _plans() -> dict[str, Plan]:
    nodes = [n.name for n in capture_model("gpt2", ARGS, batch_size=2, seq_len=SEQ).nodes]
    k = len(nodes) // 2
    first, second = tuple(nodes[:k]), tuple(nodes[k:])

    def reps(*pairs):
        return tuple(Replica(device=d, share=s) for d, s in pairs)

    def plan(groups, optimizer):
        return Plan(
            strategy="test",
            model=ModelSpec(name="gpt2", args=ARGS, batch_size=8, seq_len=SEQ),
            groups=tuple(groups),
            precision="fp16",
            optimizer=optimizer,
        ).validate()

    ring = plan(
        [
            Group(name="front", nodes=first, replicas=reps(("a", 1.0))),
            Group(name="back", nodes=second, replicas=reps(("b", 0.625), ("c", 0.375)), sync="ring"),
        ],
        "sgd",
    )
    ps = plan(
        [
            Group(name="front", nodes=first, replicas=reps(("a", 0.5), ("b", 0.5)), sync="ps", ps_device="c"),
            Group(name="back", nodes=second, replicas=reps(("a", 0.25), ("b", 0.75)), sync="ps", ps_device="b"),
        ],
        "sgd",
    )  # AdamW turns the ~0 gradient of attention key biases into ±lr noise (test_collectives
    return {"ring": ring, "ps": ps, "ps-overflow": ps}  # checks the server's AdamW exactly)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    plans = _plans()
    out = tmp_path_factory.mktemp("fp16")
    names = list(plans)
    faults = {names.index("ps-overflow"): Fault(rank=0, step=OVERFLOW_STEP, kind=FaultKind.OVERFLOW)}
    options = RunOptions(
        steps=STEPS,
        limits=Limits(timeout_s=120),
        prediction=PredictionConfig(predict=False),
        output=OutputConfig(out_dir=out, dump_params=True),
    )
    done = run_many(list(plans.values()), options, faults=faults)
    return {name: (plans[name], r, out / f"plan{i}") for i, (name, r) in enumerate(zip(names, done))}


def _compare(plan: Plan, folder, ranks: int, skip: frozenset[int] = frozenset()) -> None:
    ref = reference_train(plan, steps=STEPS, skip_steps=skip)
    seen = set()
    for rank in range(ranks):
        for name, value in torch.load(folder / f"params_rank{rank}.pt").items():
            want = ref[name]
            rel = ((value - want).norm() / want.norm().clamp_min(1e-12)).item()
            assert rel <= 1e-3, f"rank {rank} {name}: relative error {rel:.2e}"
            seen.add(name)
    assert seen == set(ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["ring", "ps"])
def test_fp16_plan_equals_single_process_fp16_with_a_loss_scaler(runs, name):
    plan, result, folder = runs[name]
    result.raise_for_failure()
    assert result.last.loss_scales == (65536.0,) * STEPS  # clean steps keep the initial scale
    assert all(p.skipped_steps == 0 for p in result.per_rank)
    _compare(plan, folder, len(result.devices))


@pytest.mark.timeout(600)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale(runs):
    plan, result, folder = runs["ps-overflow"]
    result.raise_for_failure()
    assert result.last.loss_scales == (65536.0, 32768.0, 32768.0)
    assert [p.skipped_steps for p in result.per_rank] == [1, 1, 1]
    _compare(plan, folder, len(result.devices), skip=frozenset({OVERFLOW_STEP}))
