"""Training options and input limits checked before any rank starts (no processes).

The built-in schedule equals torch's own classes; bad options name their flag; a user
optimizer that keeps more state than the plan's memory model counts is refused; a sequence
longer than the model's position table fails `heterog plan` before planning, and token ids
past the vocabulary fail both planning (a user model's example batch) and a run's first
batch (--data).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from typer.testing import CliRunner

from heterog.cli.main import run_cli
from heterog.errors import DataError, TrainingError
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.training import LRSchedule, Recipe, TrainingConfig, UserTraining, lr_factor


def _lrs(opt: torch.optim.Optimizer, sched, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_the_schedule_equals_torchs_warmup_then_decay(kind):
    warmup, steps = 3, 10
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    ours = Recipe(kind="sgd", config=TrainingConfig(lr=0.1, lr_schedule=kind, warmup_steps=warmup), steps=steps)
    got = _lrs(opt, ours.make_scheduler(opt), steps)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler
    after = {
        "cosine": sched.CosineAnnealingLR(ref_opt, T_max=steps - warmup),
        "linear": sched.LinearLR(ref_opt, start_factor=1.0, end_factor=0.0, total_iters=steps - warmup),
        "constant": sched.ConstantLR(ref_opt, factor=1.0, total_iters=0),
    }[kind]
    warm = sched.LinearLR(ref_opt, start_factor=1 / (warmup + 1), total_iters=warmup)
    want = _lrs(ref_opt, sched.SequentialLR(ref_opt, [warm, after], milestones=[warmup]), steps)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert lr_factor(TrainingConfig(lr_schedule=LRSchedule(kind), warmup_steps=warmup), steps)(0) == 1 / (warmup + 1)


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"lr": 0.0}, "--lr"),
        ({"betas": (0.9, 1.5)}, "--betas"),
        ({"lr_schedule": "step"}, "--lr-schedule"),
        ({"accumulate": 0}, "--accumulate"),
        ({"max_grad_norm": -1.0}, "--max-grad-norm"),
        ({"warmup_steps": -1}, "--warmup-steps"),
    ],
)
def test_a_bad_option_names_its_flag(options, flag):
    with pytest.raises(TrainingError, match=flag):
        TrainingConfig(**options)


def test_options_round_trip_and_options_the_plan_ignores_are_refused():
    config = TrainingConfig(lr=3e-4, betas=(0.9, 0.95), lr_schedule="cosine", max_grad_norm=1.0, accumulate=2)
    assert TrainingConfig.from_dict(config.to_dict()) == config
    with pytest.raises(TrainingError, match="--momentum applies to sgd"):
        TrainingConfig(momentum=0.9).check_for("adamw", UserTraining())
    with pytest.raises(TrainingError, match="--betas applies to adamw"):
        TrainingConfig(betas=(0.9, 0.95)).check_for("sgd", UserTraining())
    with pytest.raises(TrainingError, match="unknown field"):
        TrainingConfig.from_dict({"learning_rate": 1e-3})


def test_the_model_files_optimizer_must_fit_the_plans_memory_and_take_its_parameters():
    from heterog.execute.preflight import check_training

    plan = Plan(
        strategy="test",
        model=ModelSpec(name="tests/training_model.py:net", batch_size=8),
        groups=(Group(name="all", nodes=("inp", "act", "out"), replicas=(Replica(device="a", share=1.0),)),),
        optimizer="sgd",
    ).validate()
    with pytest.raises(TrainingError, match="re-plan with --optimizer adamw"):
        check_training(plan, TrainingConfig(max_grad_norm=1.0), steps=3)
    with pytest.raises(TrainingError, match="sets its own"):
        check_training(plan, TrainingConfig(lr=0.1), steps=3)
    bad = UserTraining(source="f.py", optimizer=lambda params: torch.optim.SGD(params[:1], lr=0.1))
    with pytest.raises(TrainingError, match="exactly the parameters it is given"):
        Recipe(kind="sgd", user=bad).make_optimizer([torch.nn.Parameter(torch.zeros(2)) for _ in range(2)])


def _cli(*args: str) -> tuple[int, str]:
    """The CLI run in this process (as tests/test_cli_errors.py does): (exit code, output)."""
    with CliRunner().isolation() as (out, err, *_):
        code = run_cli(list(args))
        return code, out.getvalue().decode() + err.getvalue().decode()


def test_plan_refuses_a_sequence_longer_than_gpt2s_positions_before_planning():
    code, output = _cli("plan", "--model", "gpt2", "--seq-len", "2048", "--batch-size", "8", "--cluster", "paper-8gpu")
    text = " ".join(output.split())
    assert code != 0 and "config.n_positions is 1024" in text and "--seq-len 1024 or less" in text, output
    assert "Traceback" not in output


TOKEN_MODEL = """\
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)

    def forward(self, ids):
        return self.head(self.tok(ids))


def tiny():
    return Tiny()


def example_batch(batch_size, seq_len):
    ids = torch.randint(0, 100, (batch_size, seq_len or 6))
    return (ids,), ids


def data(batch_size, step):
    ids = torch.full((batch_size, 6), 70)
    return (ids,), ids
"""


def test_token_ids_past_the_vocabulary_fail_at_plan_time_and_before_ranks_start(tmp_path):
    from heterog.execute.preflight import check_inputs

    path = tmp_path / "tokens.py"
    path.write_text(textwrap.dedent(TOKEN_MODEL))
    code, output = _cli(
        "plan", "--model", f"{path}:tiny", "--batch-size", "4", "--seq-len", "6", "--cluster", "emulated-4"
    )
    text = " ".join(output.split())
    assert code != 0 and "outside model" in text and "vocabulary of 50" in text, output
    plan = Plan(
        strategy="test",
        model=ModelSpec(name=f"{path}:tiny", batch_size=4, seq_len=6),
        groups=(Group(name="all", nodes=("tok", "head"), replicas=(Replica(device="a", share=1.0),)),),
    )
    with pytest.raises(DataError, match="token id 70, outside .* vocabulary of 50"):
        check_inputs(plan, f"{path}:data")


def test_the_evaluation_twin_of_an_exported_stage_runs_as_eval_mode_and_shares_its_parameters():
    from torch import nn

    from heterog.execute.evaluation import eval_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    x = torch.randn(3, 4)
    stage = torch.export.export(model, (x,), strict=False).module()  # a training graph: dropout, batch stats
    with torch.no_grad():
        for _ in range(3):  # running statistics away from their initial 0 / 1
            stage(torch.randn(3, 4) * 3 + 1)
        model[1].load_state_dict({k.split(".", 1)[1]: v for k, v in stage.state_dict().items() if k.startswith("1.")})
    twin = eval_module(stage)
    stats = [b.clone() for b in stage.buffers()]
    assert torch.allclose(twin(x), model.eval()(x), atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(stats[:2], list(stage.buffers())[:2]))  # not updated
    assert {id(p) for p in twin.parameters()} == {id(p) for p in stage.parameters()}
