"""Per-replica gradient accumulation trains exactly on real gloo processes.

A small Llama, data parallelism over three replicas of uneven batch shares (0.5 / 0.3 / 0.2),
the middle one running its share in two sequential pieces (counts 1, 2, 1), AdamW, fp32: once
unsharded in one micro-batch, once under ZeRO-2 with shard fractions unlike the shares in two
GPipe micro-batches. Every rank's parameters after 3 steps are compared with single-process
training within 1e-5 relative, and each rank ran its Program's pieces (its trace). Both plans
run in one launch of rank processes (tests/plan_batch.py).
"""

from __future__ import annotations

import pytest
from plan_batch import batch_options

from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.ir.run_request import Limits
from heterog.lower.program import Compute
from heterog.orchestrate import lower
from tests.test_lower_program import _executed_matches_program
from tests.test_shard_execute import MODELS, SEQ, STEPS, check_equal, thirds

BATCH_RUN = batch_options(steps=STEPS, limits=Limits(timeout_s=120))
COUNTS = (1, 2, 1)


def accumulating(stage: int) -> Plan:
    shares = (("a", 0.5, 0.2), ("b", 0.3, 0.3), ("c", 0.2, 0.5))  # (device, batch share, shard fraction)
    replicas = tuple(
        Replica(device=d, share=s, shard=f if stage else None, accumulate=k) for (d, s, f), k in zip(shares, COUNTS)
    )
    groups = [
        Group(name=f"part{i}", nodes=nodes, replicas=replicas, sync="ring", shard_stage=stage)
        for i, nodes in enumerate(thirds("llama"))
    ]
    # replica b holds 3 samples of a batch of 10 in one micro-batch, 2 of each of two of 12
    return Plan(
        strategy="test",
        model=ModelSpec(name="llama", args=MODELS["llama"], batch_size=12 if stage else 10, seq_len=SEQ),
        groups=tuple(groups),
        num_microbatches=2 if stage else 1,
        optimizer="adamw",
        bucket_bytes=1,  # every group its own gradient bucket (and shard unit)
    ).validate()


@pytest.mark.timeout(600)
@pytest.mark.batched(plan=accumulating)
@pytest.mark.parametrize("stage", [0, 2])
def test_a_replica_accumulating_two_pieces_trains_exactly(plan_batch, stage):
    done = plan_batch.get(accumulating, stage=stage)
    out = done.result()
    check_equal(done.plan, out, done.out_dir)
    _executed_matches_program(done)  # each rank ran its instructions, pieces at their samples
    prog = lower(done.plan)
    pieces = {(ins.microbatch, ins.piece) for ins in prog.instructions["b"] if isinstance(ins, Compute)}
    assert {j for _, j in pieces} == {0, 1}, pieces
    assert all(ins.piece == 0 for d in "ac" for ins in prog.instructions[d] if isinstance(ins, Compute))
