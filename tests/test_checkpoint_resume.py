"""Fault test on real gloo processes: a rank killed in the middle of step 5 of a 10-step run
that checkpoints every 2 steps; the run resumes from the last complete checkpoint (after 4
steps) and ends with the parameters of an uninterrupted 10-step run — under the same plan,
and under a plan for one device fewer (same global batch), loading by parameter name. These
runs follow a cosine schedule with warm-up, which a checkpoint does not hold: a resumed run
moves it on to the checkpoint's step, or its parameters would differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from heterog.errors import CheckpointError, RankError
from heterog.execute.checkpoint import MARKER, CheckpointConfig, find_checkpoint, model_key
from heterog.execute.reference import reference_train
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Fault, FaultKind, FaultPhase, Limits, OutputConfig, PredictionConfig, RunOptions
from heterog.ir.training_config import LRSchedule, TrainingConfig
from heterog.runs import run

QUIET = RunOptions(prediction=PredictionConfig(predict=False), limits=Limits(timeout_s=20))
SCHEDULED = RunOptions(
    prediction=QUIET.prediction,
    limits=QUIET.limits,
    training=TrainingConfig(lr=0.05, lr_schedule=LRSchedule.COSINE, warmup_steps=2),
)

MODEL = "tests/test_execute_models.py:mlp"
NODES = ("fc1", "act1", "fc2", "act2", "fc3")
STEPS = 10


def _replicas(*pairs) -> tuple[Replica, ...]:
    return tuple(Replica(device=d, share=s) for d, s in pairs)


def three_device_plan() -> Plan:
    """Even data parallelism over a, b, c with AdamW (so optimizer state must be restored)."""
    return Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=12),
        optimizer="adamw",
        groups=(
            Group(name="all", nodes=NODES, sync="ring", replicas=_replicas(("a", 1 / 3), ("b", 1 / 3), ("c", 1 / 3))),
        ),
    ).validate()


def two_device_plan() -> Plan:
    """Device c lost: a different plan shape too — the front on a alone, the back split 0.6/0.4."""
    return Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=12),
        optimizer="adamw",
        groups=(
            Group(name="front", nodes=NODES[:2], replicas=_replicas(("a", 1.0))),
            Group(name="back", nodes=NODES[2:], sync="ring", replicas=_replicas(("a", 0.6), ("b", 0.4))),
        ),
    ).validate()


def _params(folder: Path, ranks: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in range(ranks):
        out.update(torch.load(folder / f"params_rank{r}.pt"))
    return out


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel_tol: float) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        rel = ((got[name] - w).norm() / w.norm().clamp_min(1e-12)).item()
        assert rel <= rel_tol, f"{name}: relative difference {rel:.2e} > {rel_tol:g}"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The uninterrupted reference run, and a checkpoint folder left by a run whose rank 1
    died in the middle of step 5 (after backward, while the others wait in the sync)."""
    root = tmp_path_factory.mktemp("resume")
    run(
        three_device_plan(),
        SCHEDULED,
        steps=STEPS,
        output=OutputConfig(out_dir=root / "full", dump_params=True),
    )
    ckpt = root / "ckpt"
    with pytest.raises(RankError) as info:
        run(
            three_device_plan(),
            SCHEDULED,
            steps=STEPS,
            fault=Fault(rank=1, kind=FaultKind.DIE, step=4, phase=FaultPhase.MID),
            checkpoint=CheckpointConfig(dir=str(ckpt), every_steps=2),
            output=OutputConfig(out_dir=root / "cut"),
            limits=Limits(timeout_s=10),
        )
    assert info.value.rank == 1
    return root, _params(root / "full", 3), ckpt


@pytest.mark.slow
def test_killed_run_left_complete_checkpoints_up_to_step_4(interrupted):
    _, _, ckpt = interrupted
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
    assert all((p / MARKER).is_file() for p in ckpt.iterdir())
    info = find_checkpoint(ckpt)
    assert info.step == 4
    assert set(info.parameter_names) == {f"{n}.{k}" for n in ("fc1", "fc2", "fc3") for k in ("weight", "bias")}


@pytest.mark.slow
def test_resume_under_the_same_plan_equals_the_uninterrupted_run(interrupted):
    root, want, ckpt = interrupted
    out = run(
        three_device_plan(),
        SCHEDULED,
        steps=STEPS,
        checkpoint=CheckpointConfig(resume=str(ckpt)),
        output=OutputConfig(out_dir=root / "same", dump_params=True),
    )
    assert len(out.losses) == STEPS - 4  # steps 5..10: none lost, none repeated
    _assert_close(_params(root / "same", 3), want, 1e-6)


@pytest.mark.slow
def test_resume_on_one_device_fewer_loads_by_name(interrupted):
    root, want, ckpt = interrupted
    out = run(
        two_device_plan(),
        SCHEDULED,
        steps=STEPS,
        checkpoint=CheckpointConfig(resume=str(ckpt)),
        output=OutputConfig(out_dir=root / "fewer", dump_params=True),
    )
    assert out.devices == ("a", "b") and len(out.losses) == STEPS - 4
    _assert_close(_params(root / "fewer", 2), want, 1e-5)


def test_incomplete_checkpoint_is_ignored_and_named(tmp_path):
    (tmp_path / "step-00000006").mkdir()  # a save stopped before its marker
    with pytest.raises(CheckpointError, match="step-00000006 lack their COMPLETE.json"):
        find_checkpoint(tmp_path)


def test_resume_beyond_the_requested_steps_is_refused_before_starting_ranks(tmp_path):
    folder = tmp_path / "step-00000010"
    folder.mkdir()
    (folder / MARKER).write_text(
        '{"format": 1, "step": 10, "model": "' + model_key(MODEL) + '", "parameter_names": []}'
    )
    with pytest.raises(CheckpointError, match="already holds 10 completed steps"):
        run(
            three_device_plan(),
            QUIET,
            steps=10,
            checkpoint=CheckpointConfig(resume=str(tmp_path)),
        )


def test_checkpoint_options_are_checked():
    with pytest.raises(CheckpointError, match="needs --checkpoint-dir"):
        CheckpointConfig(every_steps=2)
    with pytest.raises(CheckpointError, match="≥ 1"):
        CheckpointConfig(dir="x", every_steps=-1)


def test_loader_data_resumes_at_the_same_batch(tmp_path):
    """A shuffling DataLoader read by step gives step k the same batch in a fresh process
    (a resumed run) as in the run that went through steps 0..k-1."""
    from heterog.workload import global_batch, resolve_workload, with_data

    (tmp_path / "data.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "def loader(batch_size):\n"
        "    x = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 16)\n"
        "    return DataLoader(TensorDataset(x, torch.arange(40) % 4), batch_size=batch_size, shuffle=True,"
        " drop_last=True)\n"
    )
    spec = three_device_plan().model

    def batches(steps):
        work = with_data(resolve_workload(spec), f"{tmp_path}/data.py:loader")
        return {k: global_batch(work, 12, seed=0, step=k)[0][0] for k in steps}

    straight = batches(range(8))  # 3 batches per epoch: steps 3..5 are epoch 1, 6..7 epoch 2
    resumed = batches(range(4, 8))
    for k in range(4, 8):
        assert torch.equal(straight[k], resumed[k]), k
    assert not torch.equal(straight[0], straight[3])  # a new epoch is shuffled anew


def server_plan() -> Plan:
    """AdamW held by parameter servers: the front by c (no replica), the back by b (a replica)."""
    return Plan(
        strategy="test",
        model=ModelSpec(name=MODEL, batch_size=12),
        optimizer="adamw",
        groups=(
            Group(name="front", nodes=NODES[:2], sync="ps", ps_device="c", replicas=_replicas(("a", 0.5), ("b", 0.5))),
            Group(name="back", nodes=NODES[2:], sync="ps", ps_device="b", replicas=_replicas(("a", 0.5), ("b", 0.5))),
        ),
    ).validate()


PS_STEPS = 6


@pytest.mark.slow
def test_parameter_server_state_is_saved_and_resumes_under_any_sync(tmp_path):
    """A run whose optimizer state lives on parameter servers, killed in step 4: resumed from
    its step-2 checkpoint under the same plan, and under a ring plan (the servers' state was
    saved per parameter), it ends with the uninterrupted run's parameters."""
    run(
        server_plan(),
        QUIET,
        steps=PS_STEPS,
        output=OutputConfig(out_dir=tmp_path / "full", dump_params=True),
    )
    want = _params(tmp_path / "full", 3)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankError):
        run(
            server_plan(),
            QUIET,
            steps=PS_STEPS,
            fault=Fault(rank=0, kind=FaultKind.DIE, step=3, phase=FaultPhase.MID),
            checkpoint=CheckpointConfig(dir=str(ckpt), every_steps=2),
            output=OutputConfig(out_dir=tmp_path / "cut"),
            limits=Limits(timeout_s=10),
        )
    assert find_checkpoint(ckpt).step == 2
    run(
        server_plan(),
        QUIET,
        steps=PS_STEPS,
        checkpoint=CheckpointConfig(resume=str(ckpt)),
        output=OutputConfig(out_dir=tmp_path / "same", dump_params=True),
    )
    _assert_close(_params(tmp_path / "same", 3), want, 1e-6)
    run(
        three_device_plan(),
        QUIET,
        steps=PS_STEPS,
        checkpoint=CheckpointConfig(resume=str(ckpt)),
        output=OutputConfig(out_dir=tmp_path / "ring", dump_params=True),
    )
    _assert_close(_params(tmp_path / "ring", 3), want, 1e-5)


@pytest.mark.slow
def test_a_resumed_server_plan_saves_the_servers_state_not_its_replicas_stale_copy(tmp_path):
    """Resumed under a plan with parameter servers, a replica of a served bucket must not keep
    the checkpoint's optimizer state in its local optimizer: that copy never moves, and saved
    again beside the server's, DCP could keep it. Ring (2 steps) → servers (to step 3, saved)
    → ring (to step 4) equals four steps of one process."""
    first, second = tmp_path / "ring", tmp_path / "ps"
    run(three_device_plan(), QUIET, steps=2, checkpoint=CheckpointConfig(dir=str(first), every_steps=2))
    run(
        server_plan(),
        QUIET,
        steps=3,
        checkpoint=CheckpointConfig(dir=str(second), every_steps=1, resume=str(first)),
    )
    out = run(
        three_device_plan(),
        QUIET,
        steps=4,
        checkpoint=CheckpointConfig(resume=str(second)),
        output=OutputConfig(out_dir=tmp_path / "last", dump_params=True),
    )
    assert out.resumed_from is not None and out.resumed_from.step == 3
    assert out.resumed_from.saved_under is not None and out.resumed_from.saved_under.devices == ("a", "b", "c")
    _assert_close(_params(tmp_path / "last", 3), reference_train(three_device_plan(), steps=4), 1e-5)
