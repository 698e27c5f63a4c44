"""What the executor sends between blocks is what the Program sends (and the simulator times).

The Program moves a tensor between two blocks wherever the capture's edges cross them; the
executor moves the values of its split model that cross the same blocks. If the two differ,
the prediction times transfers that never happen (a language model's 67 MB of logits sent to
a loss placed on another device, which the executor computed beside lm_head: predicted 52 %
above the measured time on lm-slow-link), or the run moves bytes nobody predicted. Per block
pair, the forward bytes of the Program's sends must equal the bytes of the values the executor
sends (their per-sample size from the export, times the samples of the Program's sends).
No processes: the split and the Program are built here.
"""

from __future__ import annotations

import pytest
import torch

from heterog.capture import capture_model
from heterog.cut.partition import build_dataflow, program_group_order
from heterog.execute.stage_map import crossing_values
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.lower.program import Phase, Send
from heterog.orchestrate import lower
from heterog.workload import build_model, resolve_workload

SEQ = 8
GPT2 = dict(hidden=32, layers=2, heads=4, vocab=96, positions=32, dropout=0.0)
EXAMPLE_BATCH = 4  # partition.example_batch_for: the export's batch for a plan of batch ≥ 4


def _plan(groups: list[tuple[str, tuple[str, ...], tuple[tuple[str, float], ...]]]) -> Plan:
    return Plan(
        strategy="test",
        model=ModelSpec(name="gpt2", args=GPT2, batch_size=8, seq_len=SEQ),
        groups=tuple(
            Group(
                name=n,
                nodes=nodes,
                replicas=tuple(Replica(device=d, share=s) for d, s in reps),
                sync="ring" if len(reps) > 1 else "none",
            )
            for n, nodes, reps in groups
        ),
        num_microbatches=2,
        schedule="gpipe",
        optimizer="sgd",
        cluster={},
    ).validate()


def _sent_bytes(plan: Plan) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """(Program, executor): forward bytes per (producer block, consumer block)."""
    program = lower(plan)
    flow = build_dataflow(
        build_model(resolve_workload(plan.model), seed=0), plan, 1, group_order=program_group_order(program)
    )
    crossing = crossing_values(program, flow)
    outputs = {
        s.value: next(n for n in s.module.graph.nodes if n.op == "output").args[0]
        for s in flow.stages
        if hasattr(s.module, "graph")
    }

    def per_sample_bytes(v: str) -> float:
        src, index = flow.projections.get(v, (v, None))
        node = outputs[src] if index is None else outputs[src][index]
        val = node.meta["val"]
        numel = 1
        for d in val.shape:
            numel *= d.node.hint if isinstance(d, torch.SymInt) else int(d)
        return numel * val.element_size() / EXAMPLE_BATCH

    ours: dict[tuple[int, int], float] = {}
    theirs: dict[tuple[int, int], float] = {}
    for instructions in program.instructions.values():
        for ins in instructions:
            if isinstance(ins, Send) and ins.phase == Phase.FORWARD:
                key = (ins.src_block, ins.dst_block)
                ours[key] = ours.get(key, 0.0) + ins.nbytes
                theirs[key] = theirs.get(key, 0.0) + (ins.hi - ins.lo) * sum(
                    per_sample_bytes(v) for v in crossing.get(key, ())
                )
    return ours, theirs


def _nodes() -> list[str]:
    return [n.name for n in capture_model("gpt2", GPT2, batch_size=2, seq_len=SEQ).nodes]


@pytest.mark.parametrize("where", ["loss-apart", "head-and-loss-apart"])
def test_the_executor_sends_what_the_program_sends(where):
    nodes = _nodes()
    loss = tuple(n for n in nodes if n.startswith("loss::"))
    cut = nodes.index("lm_head") if where == "head-and-loss-apart" else len(nodes) - len(loss)
    body, tail = tuple(nodes[:cut]), tuple(n for n in nodes[cut:] if n not in loss)
    groups = [("body", body, (("a", 1.0),))]
    if tail:
        groups.append(("head", tail, (("b", 1.0),)))
    groups.append(("loss", loss, (("b", 0.5), ("c", 0.5))))
    program_bytes, executor_bytes = _sent_bytes(_plan(groups))
    assert program_bytes, "the plan crosses devices, so the Program sends"
    for key, nbytes in program_bytes.items():
        assert executor_bytes[key] == pytest.approx(nbytes, rel=1e-6), (
            f"blocks {key}: the Program sends {nbytes:.0f} B forward, the executor {executor_bytes[key]:.0f} B"
        )
