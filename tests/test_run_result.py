"""The run side's artifacts: RunOptions and RunRequest (what a run is asked), RunResult (what it
measured beside what was predicted), and the ranks' spec and result (execute/spec.py) —
versioned, validated on load with the offending field named, and the same after a round trip.
No processes are started here (tests/test_lower_program.py runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from heterog.errors import ArtifactError, CheckpointError, PlanError, TrainingError
from heterog.execute.spec import LaunchSpec, PlanEntry, RankResult, RankSpec, read_spec
from heterog.ir.kinds import InstructionKind, Phase
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import (
    CheckpointConfig,
    DeviceLayout,
    Fault,
    FaultKind,
    FaultPhase,
    OutputConfig,
    RunOptions,
    RunRequest,
    TimingConfig,
)
from heterog.ir.run_result import (
    InstructionTiming,
    RankSummary,
    Repetition,
    RunFailedError,
    RunFailure,
    RunResult,
    Span,
    SpanCategory,
    StepRecord,
    combine_repetitions,
)
from heterog.ir.training_config import TrainingConfig


def _plan() -> Plan:
    return Plan(
        strategy="one",
        model=ModelSpec(name="mlp", batch_size=4),
        groups=(Group(name="all", nodes=("0",), replicas=(Replica(device="a", share=1.0),)),),
    )


def _rank(rank: int, device: str, step_time_s: float) -> RankSummary:
    return RankSummary(
        rank=rank, device=device, slowdown=1.0, cores=None, groups=("all",), step_time_s=step_time_s,
        compute_s=0.1, cpu_s=0.1, paced_s=0.0, recv_wait_s=0.0, sync_s=0.0, other_s=0.0,
        sent_bytes_total=0, max_rss_bytes=1, peak_live_bytes=10, peak_allocated_bytes=99,
    )  # fmt: skip


def _timing(device: str, op: int, kind: InstructionKind, predicted_s: float, measured_s: float) -> InstructionTiming:
    return InstructionTiming(
        id=f"{op}@{device}", device=device, rank=0, index=op, op=op, kind=kind,
        phase=Phase.FORWARD if kind is InstructionKind.COMPUTE else None, name="x",
        predicted_start_s=1.0, predicted_end_s=1.0 + predicted_s, measured_s=measured_s,
    )  # fmt: skip


def _result(times: tuple[float, ...] = (1.0,), predicted: float | None = 1.0) -> RunResult:
    reps = tuple(
        Repetition(measured_iteration_time_s=t, measured_steps=2, losses=(2.0, 1.5, 1.0), per_rank=(_rank(0, "a", t),))
        for t in times
    )
    return RunResult(
        strategy="one",
        model="mlp",
        cluster="local-cpu",
        devices=("a",),
        options=RunOptions(steps=3),
        repetitions=reps,
        predicted_iteration_time_s=predicted,
        prediction_source="simulator" if predicted else "not requested",
        instructions=(
            _timing("a", 0, InstructionKind.COMPUTE, 0.010, 0.012),
            _timing("a", 1, InstructionKind.RECV, 0.001, 0.020),
            _timing("b", 1, InstructionKind.SEND, 0.0, 0.0005),
            _timing("b", 2, InstructionKind.COMPUTE, 0.030, 0.020),
        ),
        spans=(Span(name="s", category=SpanCategory.STEP, rank=0, step=1, start_s=5.0, end_s=6.0),),
    )


def test_options_are_grouped_checked_and_written_as_they_read(tmp_path):
    opts = RunOptions(steps=3).with_(
        layout=DeviceLayout(emulated=True), output=OutputConfig(out_dir=Path(tmp_path)), seed=7
    )
    assert opts.output.out_dir == str(tmp_path)  # a Path is kept as text, so it writes to JSON
    assert RunOptions.from_dict(json.loads(json.dumps(opts.to_dict()))) == opts
    with pytest.raises(PlanError, match="unknown run option.*emulated.*DeviceLayout"):
        opts.with_(emulated=True)
    with pytest.raises(PlanError, match="steps must be ≥ 1"):
        RunOptions(steps=0)
    with pytest.raises(PlanError, match="repetitions ≥ 1"):
        TimingConfig(repetitions=0)
    with pytest.raises(CheckpointError, match="needs --checkpoint-dir"):
        CheckpointConfig(every_steps=2)
    assert Fault(rank=1, kind="die", step=2).kind is FaultKind.DIE  # from a test's plain string
    assert Fault(rank=1, kind=FaultKind.DIE, step=2, phase="mid").hits(1, 2, FaultPhase.MID)


def test_a_run_request_is_a_versioned_file(tmp_path):
    training = TrainingConfig(lr=3e-4, betas=(0.9, 0.95), lr_schedule="cosine", accumulate=2, data="d.py:loader")
    req = RunRequest(plan=_plan(), options=RunOptions(steps=4, timing=TimingConfig(warmup_steps=0), training=training))
    req.save(tmp_path / "req.json")
    assert RunRequest.load(tmp_path / "req.json") == req  # the training options with it: the run can be made again
    doc = json.loads((tmp_path / "req.json").read_text())
    assert doc["options"]["training"]["lr_schedule"] == "cosine" and doc["options"]["training"]["betas"] == [0.9, 0.95]
    bad = {**doc, "options": {**doc["options"], "training": {**doc["options"]["training"], "accumulate": 0}}}
    (tmp_path / "bad_training.json").write_text(json.dumps(bad))
    with pytest.raises(TrainingError, match="--accumulate must be ≥ 1"):
        RunRequest.load(tmp_path / "bad_training.json")
    doc["options"]["timing"]["warmup_steps"] = "one"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r"options\.timing\.warmup_steps: expected int"):
        RunRequest.load(tmp_path / "bad.json")


def test_a_run_result_survives_its_file_and_names_a_bad_field(tmp_path):
    result = _result()
    result.save(tmp_path / "run.json")
    assert RunResult.load(tmp_path / "run.json") == result
    doc = json.loads((tmp_path / "run.json").read_text())
    # the derived figures are written for readers of the JSON, as the properties give them
    assert doc["measured_iteration_time_s"] == 1.0 and doc["losses"] == [2.0, 1.5, 1.0]
    assert doc["per_rank"][0]["device"] == "a" and doc["by_kind"][0]["kind"] == "recv"
    doc["repetitions"][0]["per_rank"][0]["rank"] = "zero"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r"repetitions\[0\]\.per_rank\[0\]\.rank: expected int, found 'zero'"):
        RunResult.load(tmp_path / "bad.json")
    from heterog.report.inputs import load_run

    (tmp_path / "plan.json").write_text(_plan().to_json())
    with pytest.raises(ArtifactError, match="heterog run plan.json --out run.json"):
        load_run(tmp_path / "plan.json")


def test_repetitions_combine_into_median_spread_and_one_prediction():
    runs = [_result((1.0,)), _result((1.2,), predicted=None), _result((1.1,), predicted=None)]
    got = combine_repetitions(runs)
    assert got.repetitions_s == (1.0, 1.2, 1.1)
    assert got.measured_iteration_time_s == pytest.approx(1.1) and got.spread == pytest.approx(0.2)
    assert got.predicted_iteration_time_s == 1.0 and got.relative_error == pytest.approx(0.1)


def test_per_instruction_comparison_puts_the_largest_misses_first():
    result = _result()
    rows = result.by_kind()
    assert [(r.device, r.kind) for r in rows] == [("a", "recv"), ("b", "forward"), ("a", "forward"), ("b", "send")]
    assert rows[0].miss_s == pytest.approx(0.019) and rows[1].miss_s == pytest.approx(-0.010)
    assert [i.id for i in result.largest_misses(2)] == ["1@a", "2@b"]
    assert result.per_rank[0].measured_peak_memory_bytes == 10  # the capped device's live tensors


def test_a_failed_run_says_what_stopped_it(tmp_path):
    failed = RunResult(
        strategy="one",
        model="mlp",
        cluster=None,
        devices=(),
        failure=RunFailure(type="RankError", message="rank 1: died", rank=1),
    )
    assert not failed.ok and failed.measured_iteration_time_s is None
    with pytest.raises(RunFailedError, match="RankError: rank 1: died"):
        failed.raise_for_failure()
    assert RunResult.from_dict(failed.to_dict()) == failed
    from heterog.report.inputs import load_run

    failed.save(tmp_path / "failed.json")
    with pytest.raises(ArtifactError, match="the run failed .RankError: rank 1: died.; nothing was measured"):
        load_run(tmp_path / "failed.json")


def test_the_ranks_spec_and_result_are_typed_files(tmp_path):
    spec = RankSpec(
        program={"devices": ["a"]},
        devices=("a", "b"),
        rank=1,
        steps=3,
        fault=Fault(rank=1, kind=FaultKind.HANG, step=2),
        checkpoint=CheckpointConfig(resume="ckpt"),
    )
    spec.save(tmp_path / "spec.json")
    assert read_spec(tmp_path / "spec.json") == spec
    entry = PlanEntry(index=2, devices=("b",), processes=(1,), program={}, out_dir="o", wait_s=9.0)
    launch = LaunchSpec(rank=1, world=2, steps=3, seed=5, plans=(entry,))
    launch.save(tmp_path / "launch.json")
    got = read_spec(tmp_path / "launch.json")
    assert got == launch and got.rank_spec(entry).rank == 0 and got.rank_spec(entry).seed == 5
    step = StepRecord(step=0, rank=0, device="a", loss=1.0, step_time_s=0.5, compute_s=0.2, sync_s=0.1)
    ran = RankResult(
        rank=0, device="a", slowdown=2.0, cores=(1,), groups=("all",), steps=(step,), spans=(), sent_bytes=8,
        max_rss_bytes=1,
    )  # fmt: skip
    ran.save(RankResult.path(tmp_path, 0))
    assert RankResult.load(RankResult.path(tmp_path, 0)) == ran and step.other_s == pytest.approx(0.2)
