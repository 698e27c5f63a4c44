"""Sharded groups train with the run's training options as one process does: the model file's
optimizer (AdamW whose parameter groups are chosen by each tensor's dimension, so a piece
that holds the end of a weight and a bias must step each with its own weight decay), its
schedule, gradients clipped to a global norm (each piece's summed gradient counted once),
2 batches accumulated per step (the stage-3 gathers and reduce-scatters run in the
accumulating steps too) and an evaluation crossing a stage-3 block (forward gathers only);
the run's per-instruction comparison holds every sharded collective.

The plan: the front layer sharded at stage 3 and the output layer at stage 1 over three
devices with uneven batch shares (0.5 / 0.25 / 0.25) and other shard fractions, so that the
last member's piece of each spans a weight's end and its bias. One run of 3 steps on real
gloo processes, compared with a plain single-process loop over the same functions.
"""

from __future__ import annotations

from html import escape

import pytest
import torch
import training_model as user

from heterog.execute.evaluation import eval_batches
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Limits, OutputConfig, RunOptions
from heterog.ir.run_result import RunResult
from heterog.ir.training_config import TrainingConfig
from heterog.lower.program import Program
from heterog.report.instructions import instruction_section
from heterog.runs import run
from heterog.workload import build_model, global_batch, resolve_workload

MODEL = "tests/training_model.py:net"
STEPS = 3
BATCH = 8
ACCUMULATE = 2
MAX_NORM = 0.5
TRAINING = TrainingConfig(max_grad_norm=MAX_NORM, accumulate=ACCUMULATE, eval_every=2, eval_batches=2)


def _replicas(shards: tuple[float, ...]) -> tuple[Replica, ...]:
    return tuple(Replica(device=d, share=s, shard=f) for d, s, f in zip("abc", (0.5, 0.25, 0.25), shards))


def _plan() -> Plan:
    return Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=BATCH),
        groups=(
            # inp: 384 weight + 24 bias elements; c's piece [204, 408) holds both
            Group(name="front", nodes=("inp", "act"), replicas=_replicas((0.2, 0.3, 0.5)), sync="ring", shard_stage=3),
            # out: 96 + 4; c's piece [80, 100) holds both
            Group(name="back", nodes=("out",), replicas=_replicas((0.5, 0.3, 0.2)), sync="ring", shard_stage=1),
        ),
        num_microbatches=2,
        optimizer="adamw",
        bucket_bytes=1,  # each group its own shard unit
    ).validate()


def _torch_loop(plan: Plan):
    """(parameters, evaluation loss at step 2, learning rates, gradient norms) of one process."""
    work = resolve_workload(plan.model)
    model = build_model(work, seed=0)
    opt = user.optimizer(list(model.parameters()))
    sched = user.scheduler(opt)
    held_out = eval_batches(work, "tests/training_model.py:eval_loader", BATCH, seed=0, count=2)
    eval_loss, lrs, norms = None, [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for j in range(ACCUMULATE):
            inputs, targets = global_batch(work, BATCH, seed=0, step=step * ACCUMULATE + j)
            (work.loss(model(*inputs), targets) / ACCUMULATE).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if step + 1 == 2:
            with torch.no_grad():
                eval_loss = sum(float(work.loss(model(*x), y)) for x, y in held_out) / len(held_out)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss, lrs, norms


@pytest.mark.timeout(300)
def test_sharded_groups_step_with_the_model_files_optimizer_clipping_accumulation_and_evaluation(tmp_path):
    plan = _plan()
    options = RunOptions(
        steps=STEPS,
        training=TRAINING,
        limits=Limits(timeout_s=60),
        output=OutputConfig(out_dir=str(tmp_path), dump_params=True),
    )
    out = run(plan, options)
    want, eval_loss, lrs, norms = _torch_loop(plan)
    assert max(norms) > MAX_NORM, f"the clip never engaged (norms {norms}): the test would not test it"
    assert out.training is not None and out.training["optimizer_from"] == "model file"
    assert [g["weight_decay"] for g in out.training["param_groups"]] == [0.1, 0.0]  # as the model holds them
    assert out.learning_rates is not None and list(out.learning_rates) == lrs
    assert out.grad_norms is not None and list(out.grad_norms) == pytest.approx(norms, rel=1e-5)
    assert [e["step"] for e in out.evaluations] == [2]
    assert out.evaluations[0]["eval/loss"] == pytest.approx(eval_loss, rel=1e-5)
    seen = set()
    for rank in range(3):
        for name, value in torch.load(tmp_path / f"params_rank{rank}.pt").items():
            rel = ((value - want[name]).norm() / want[name].norm()).item()
            assert rel <= 1e-5, f"rank {rank} {name}: relative error {rel:.2e}"
            seen.add(name)
    assert seen == set(want), f"parameters held by no rank: {set(want) - seen}"
    _check_instructions(out, tmp_path)


def _check_instructions(out: RunResult, tmp_path) -> None:
    """The per-instruction comparison covers the sharded collectives: every instruction of the
    Program, each stage-3 gather and reduce-scatter with one span per accumulated batch, is
    predicted and measured, and `heterog report --run` draws them beside their simulation
    (report/instructions.py)."""
    prog = Program.load(tmp_path / "program.json")
    assert sorted(i.id for i in out.instructions) == sorted(prog.locations())
    assert all(i.predicted_s is not None and i.measured_s is not None for i in out.instructions)
    sharded = [i for i in out.instructions if "reduce-scatter" in i.name or "all-gather" in i.name]
    assert {i.device for i in sharded} == set("abc") and any(" mb1" in i.name for i in sharded), sharded
    assert f"<title>{sharded[0].id}: {escape(sharded[0].name)}</title>" in instruction_section(out)
