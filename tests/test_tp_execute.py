"""Tensor-parallel plans train exactly on real gloo processes.

Small GPT-2 and Llama configurations split Megatron-style (execute/tp_split.py): GPT-2 under
tensor parallelism of degree 2; Llama at degree 2 with two data-parallel replicas of uneven
batch shares (0.6 / 0.4) whose state is sharded by ZeRO-1 with fractions unlike the shares;
and Llama on 8 ranks as tp 2 × a two-stage 1F1B pipeline × uneven data parallelism 2. AdamW,
fp32, gradients clipped to a global norm of 0.5 (the models' first norms are 1.4 and 1.0, so
a slice counted twice or a whole parameter counted on every member would change the steps);
every rank's parameters after 3 steps, made whole from the members' slices, are
compared with single-process training of the unsplit model within 1e-5 relative
(test_shard_execute.check_equal), and the losses with its losses. The plans run one after
the other in one launch of rank processes (tests/plan_batch.py).
"""

from __future__ import annotations

import pytest
from plan_batch import BatchedRun, batch_options
from test_shard_execute import STEPS, check_equal, make_plan, node_names

from heterog.execute.checkpoint import CheckpointConfig
from heterog.execute.reference import reference_train
from heterog.ir.plan import Group, Plan, Replica
from heterog.ir.run_request import Limits, OutputConfig, PredictionConfig, RunOptions
from heterog.ir.training_config import TrainingConfig
from heterog.runs import run

# gradients clipped to a global norm (each slice counted once, each whole parameter on one member)
MAX_NORM = 0.5
BATCH_RUN = batch_options(steps=STEPS, limits=Limits(timeout_s=180), training=TrainingConfig(max_grad_norm=MAX_NORM))


def tp2(name: str) -> Plan:
    replica = Replica(device="a", share=1.0, tp_devices=("b",))
    return make_plan(name, [Group(name="all", nodes=node_names(name), replicas=(replica,))])


def tp2_zero1() -> Plan:
    replicas = (
        Replica(device="a", share=0.6, shard=0.3, tp_devices=("b",)),
        Replica(device="c", share=0.4, shard=0.7, tp_devices=("d",)),
    )
    group = Group(name="all", nodes=node_names("llama"), replicas=replicas, sync="ring", shard_stage=1)
    return make_plan("llama", [group])


def tp2_pp2_dp2() -> Plan:
    nodes = node_names("llama")
    k = len(nodes) // 2
    stage = [(("a", "b"), ("c", "d"), (0.6, 0.4)), (("e", "f"), ("g", "h"), (0.5, 0.5))]
    groups = [
        Group(
            name=f"stage{i}",
            nodes=part,
            sync="ring",
            replicas=tuple(Replica(device=m[0], share=s, tp_devices=m[1:]) for m, s in zip(sets[:2], sets[2])),
        )
        for i, (part, sets) in enumerate(zip((nodes[:k], nodes[k:]), stage))
    ]
    return make_plan("llama", groups, microbatches=3, schedule="1f1b")


def check_batched(done: BatchedRun) -> None:
    out = done.result()
    check_equal(done.plan, out, done.out_dir, max_grad_norm=MAX_NORM)
    losses: list[float] = []
    reference_train(done.plan, steps=STEPS, losses=losses, max_grad_norm=MAX_NORM)
    assert out.losses == pytest.approx(losses, rel=1e-5)  # each set's first member reports it


@pytest.mark.timeout(600)
@pytest.mark.batched(plan=tp2)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_tp2_trains_exactly(plan_batch, name):
    done = plan_batch.get(tp2, name=name)
    check_batched(done)
    # each all-reduce is a measured span: 2 blocks × 2 regions × (g forward, f backward) × 2 micro-batches
    for rank in (0, 1):
        for step in range(STEPS):
            spans = [s for s in done.run.spans if s.rank == rank and s.step == step and s.category == "tp"]
            assert len(spans) == 16 and all(s.end_s >= s.start_s for s in spans)


@pytest.mark.timeout(600)
@pytest.mark.batched(plan=tp2_zero1)
def test_tp2_with_uneven_zero1_replicas_trains_exactly(plan_batch):
    check_batched(plan_batch.get(tp2_zero1))


@pytest.mark.timeout(600)
@pytest.mark.batched(plan=tp2_pp2_dp2)
def test_tp2_pp2_1f1b_dp2_on_eight_ranks_trains_exactly(plan_batch):
    check_batched(plan_batch.get(tp2_pp2_dp2))


def _dp2(shard_stage: int = 0, tp: bool = False) -> Plan:
    """Llama on two replicas of shares 0.6 / 0.4; with `tp`, each a tensor-parallel pair."""
    shards = (0.3, 0.7) if shard_stage else (None, None)
    replicas = (
        Replica(device="a", share=0.6, shard=shards[0], tp_devices=("b",) if tp else ()),
        Replica(device="c" if tp else "b", share=0.4, shard=shards[1], tp_devices=("d",) if tp else ()),
    )
    group = Group(name="all", nodes=node_names("llama"), replicas=replicas, sync="ring", shard_stage=shard_stage)
    return make_plan("llama", [group])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("degrees", [(1, 2), pytest.param((1, 2, 1), marks=pytest.mark.sweep)])
def test_checkpoints_resume_across_tensor_parallel_degrees(tmp_path, degrees):
    """Step 1 without tensor parallelism; step 2 resumed at degree 2 with ZeRO-1 (each member
    reads its slice of the whole parameters and AdamW state, and saves them whole again);
    (in the sweep) step 3 resumed at degree 1: the parameters equal uninterrupted training."""
    plans = [_dp2(shard_stage=1, tp=True) if d == 2 else _dp2() for d in degrees]
    quiet = RunOptions(prediction=PredictionConfig(predict=False), limits=Limits(timeout_s=180))
    for step, plan in enumerate(plans, start=1):
        out = run(
            plan,
            quiet,
            steps=step,
            checkpoint=CheckpointConfig(dir=str(tmp_path / f"ckpt{step}"), every_steps=1,
                                        resume=str(tmp_path / f"ckpt{step - 1}") if step > 1 else None),
            output=OutputConfig(out_dir=str(tmp_path / f"run{step}"), dump_params=True),
        )  # fmt: skip
        assert len(out.losses) == 1
    check_equal(plans[-1], out, tmp_path / f"run{len(plans)}", steps=len(plans))
