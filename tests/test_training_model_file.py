"""The model file's own optimizer, scheduler, evaluate and eval loader under a plan with a
parameter server and a pipeline cut, and the metrics a run writes (JSON lines and
TensorBoard events read back with tensorboard's own reader).

The plan: the front layer replicated on devices a and b (shares 0.5 / 0.5) and synced by a
parameter server on c, which also runs the output layer: the server steps the front's
parameters with the file's optimizer — AdamW whose parameter groups are chosen by each
tensor's dimension, so the server must hand it tensors of the real shapes — and evaluation
crosses the cut forward-only. One run of 4 steps with --eval-every 2 --log-dir, compared
with a plain single-process loop over the same functions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from heterog.execute.evaluation import eval_batches
from heterog.execute.metrics import read_metrics
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Limits, OutputConfig, PredictionConfig, RunOptions
from heterog.ir.training_config import TrainingConfig
from heterog.runs import run
from heterog.workload import build_model, global_batch, resolve_workload

MODEL = "tests/training_model.py:net"
STEPS = 4
BATCH = 8
MAX_NORM = 0.5
TRAINING = TrainingConfig(max_grad_norm=MAX_NORM, eval_every=2, eval_batches=2)


def _plan() -> Plan:
    return Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=BATCH),
        groups=(
            Group(
                name="front",
                nodes=("inp", "act"),
                replicas=(Replica(device="a", share=0.5), Replica(device="b", share=0.5)),
                sync="ps",
                ps_device="c",
            ),
            Group(name="back", nodes=("out",), replicas=(Replica(device="c", share=1.0),)),
        ),
        optimizer="adamw",
    ).validate()


def _torch_loop(plan: Plan):
    """(parameters, evaluations by step, learning rates, gradient norms) of one process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("training_model", "tests/training_model.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    work = resolve_workload(plan.model)
    model = build_model(work, seed=0)
    opt = user.optimizer(list(model.parameters()))
    sched = user.scheduler(opt)
    held_out = eval_batches(work, "tests/training_model.py:eval_loader", BATCH, seed=0, count=2)
    evals, lrs, norms = {}, [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        inputs, targets = global_batch(work, BATCH, seed=0, step=step)
        work.loss(model(*inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if (step + 1) % 2 == 0:
            with torch.no_grad():
                outs = [(model(*x), y) for x, y in held_out]
            evals[step + 1] = {
                "eval/loss": sum(float(work.loss(o, y)) for o, y in outs) / len(outs),
                "eval/accuracy": sum(float(user.evaluate(o, y)["accuracy"]) for o, y in outs) / len(outs),
            }
    return {n: p.detach().clone() for n, p in model.named_parameters()}, evals, lrs, norms


def test_the_model_files_optimizer_scheduler_and_evaluation_and_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = _plan()
    logs = tmp_path / "logs"
    options = RunOptions(
        steps=STEPS,
        output=OutputConfig(out_dir=tmp_path / "run", dump_params=True),
        prediction=PredictionConfig(predict=False),
        limits=Limits(timeout_s=60),
        training=dataclasses.replace(TRAINING, log_dir=str(logs)),
    )
    out = run(plan, options)
    want, evals, lrs, norms = _torch_loop(plan)
    assert max(norms) > MAX_NORM  # the clip engages
    assert out.training is not None and out.learning_rates is not None
    assert out.training["optimizer"] == "AdamW" and out.training["optimizer_from"] == "model file"
    assert [g["weight_decay"] for g in out.training["param_groups"]] == [0.1, 0.0]
    assert list(out.learning_rates) == lrs and out.grad_norms == pytest.approx(norms)
    for rank in range(3):
        for name, value in torch.load(tmp_path / "run" / f"params_rank{rank}.pt").items():
            rel = ((value - want[name]).norm() / want[name].norm()).item()
            assert rel <= 1e-5, f"rank {rank} {name}: relative error {rel:.2e}"
    got = {e["step"]: e for e in out.evaluations}
    assert sorted(got) == [2, 4]
    for step, metrics in evals.items():
        for key, value in metrics.items():
            assert abs(got[step][key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, got[step][key], value)
    # the metrics file and the TensorBoard events say the same
    lines = read_metrics(logs)
    assert lines[0]["kind"] == "run" and lines[0]["max_grad_norm"] == MAX_NORM
    train = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in train] == [1, 2, 3, 4]
    events = EventAccumulator(str(logs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "eval/loss", "eval/accuracy"} <= tags
    for tag in ("train/loss", "train/lr", "train/grad_norm"):
        read = [(e.step, e.value) for e in events.Scalars(tag)]
        assert read == [(line["step"], pytest.approx(line[tag], rel=1e-6)) for line in train], tag
    assert [e.step for e in events.Scalars("eval/accuracy")] == [2, 4]
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx(
        [evals[2]["eval/loss"], evals[4]["eval/loss"]], rel=1e-5
    )
    assert [line["train/loss"] for line in train] == pytest.approx(out.losses, rel=1e-6)
