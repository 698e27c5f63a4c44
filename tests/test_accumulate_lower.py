"""Per-replica gradient accumulation in the plan, the lowering and the simulator.

- `Replica.accumulate` is validated with messages that say what to fix (at least 1, at most
  the replica's samples, only where every group has one placement, not under ZeRO-3), and
  survives JSON as an optional field that older plans lack;
- a replica's peak memory falls as its count rises, its pieces run one after another, and
  the merged simulation equals the unmerged one;
- random data-parallel plans with counts: every task of the schedule is exactly one
  instruction, and each replica's pieces tile its sample range.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from heterog.errors import PlanError
from heterog.ir.accumulation import accumulation_pieces
from heterog.ir.plan import Plan, Replica, split_samples
from heterog.lower.lowering import to_program
from heterog.lower.program import Compute
from heterog.lower.schedule import build_schedule
from heterog.simulate import simulate
from heterog.simulate.simulator import time_schedule
from tests.simulate_support import TableCosts, chain_graph, cluster, plan
from tests.test_lower_program import _expected_signatures, _signature

RATE = 1e12
LAYERS = 6


def _setup():
    g = chain_graph(LAYERS, flops=1e9, edge_bytes=4e6, param_bytes=100_000)
    c = cluster([[RATE, 2 * RATE], [RATE]], nic_bandwidth=1e9, latency_s=1e-6)
    return g, c, [d.name for d in c.devices]


def _data_parallel(devices, shares, counts, *, groups: int = 2, batch: int = 12, **kw) -> Plan:
    """Every group on the same replicas (data parallelism), each replica with its count."""
    nodes = [f"l{i}" for i in range(LAYERS)]
    k = LAYERS // groups
    p = plan(
        [(f"g{i}", nodes[i * k : (i + 1) * k], list(zip(devices, shares))) for i in range(groups)],
        batch_size=batch,
        **kw,
    )
    return _with_counts(p, counts)


def _with_counts(p: Plan, counts) -> Plan:
    def counted(g):
        reps = tuple(dataclasses.replace(r, accumulate=k) for r, k in zip(g.replicas, counts))
        return dataclasses.replace(g, replicas=reps)

    return dataclasses.replace(p, groups=tuple(counted(g) for g in p.groups))


def test_counts_are_validated_with_what_to_fix():
    _, _, devs = _setup()
    shares = (0.5, 0.3, 0.2)
    _data_parallel(devs, shares, (1, 2, 1)).validate()
    with pytest.raises(PlanError, match="accumulate must be an integer ≥ 1"):
        _data_parallel(devs, shares, (1, 0, 1)).validate()
    with pytest.raises(PlanError, match=r"accumulate 5 exceeds its 4 sample\(s\) of micro-batch 0"):
        _data_parallel(devs, shares, (1, 5, 1)).validate()
    mixed = _data_parallel(devs, shares, (1, 2, 1))
    other = dataclasses.replace(mixed.groups[1], replicas=(Replica(device=devs[0], share=1.0, accumulate=2),))
    with pytest.raises(PlanError, match="every group has the same replicas, shares and counts"):
        dataclasses.replace(mixed, groups=(mixed.groups[0], other)).validate()
    zero3 = dataclasses.replace(
        mixed,
        groups=tuple(
            dataclasses.replace(
                g, shard_stage=3, replicas=tuple(dataclasses.replace(r, shard=1 / 3) for r in g.replicas)
            )
            for g in mixed.groups
        ),
    )
    with pytest.raises(PlanError, match="ZeRO-3 group.*Use shard_stage 1 or 2"):
        zero3.validate()


def test_counts_survive_json_and_plans_without_them_load_with_one():
    _, _, devs = _setup()
    p = _data_parallel(devs, (0.4, 0.3, 0.3), (1, 2, 3)).validate()
    doc = json.loads(json.dumps(p.to_dict()))
    assert doc["groups"][0]["accumulate"] == [1, 2, 3]
    assert Plan.from_dict(doc).groups[0].replicas[2].accumulate == 3
    plain = _data_parallel(devs, (0.5, 0.3, 0.2), (1, 1, 1)).to_dict()
    assert "accumulate" not in plain["groups"][0]
    assert {r.accumulate for g in Plan.from_dict(plain).groups for r in g.replicas} == {1}
    doc["groups"][0]["accumulate"] = [1, 2]
    with pytest.raises(PlanError, match="accumulate \\(when given\\) one integer ≥ 1 per replica"):
        Plan.from_dict(doc)


def test_pieces_split_a_replicas_samples_as_the_plan_splits_a_batch():
    for n in range(0, 12):
        for k in range(1, 5):
            pieces = accumulation_pieces(n, k)
            assert [hi - lo for lo, hi in pieces] == split_samples(n, [1.0] * k)
            assert pieces[0][0] == 0 and pieces[-1][1] == n


@pytest.mark.parametrize("schedule,microbatches", [("gpipe", 1), ("gpipe", 2), ("1f1b", 2)])
def test_a_replicas_peak_falls_with_its_count(schedule, microbatches):
    """Its activations are those of one piece: the peak of the accumulating replica falls
    with each count, the others' do not rise, and the iteration pays the extra pieces."""
    g, c, devs = _setup()
    costs = TableCosts(g, c)
    peaks, times = [], []
    for k in (1, 2, 4):  # the largest piece of its 7 or 4 samples: 7, 4, 2 or 4, 2, 1
        p = _data_parallel(devs, (0.4, 0.3, 0.3), (1, k, 1), batch=24, num_microbatches=microbatches)
        p = dataclasses.replace(p, schedule=schedule).validate(g, c)
        res = simulate(g, c, p, costs)
        unmerged = time_schedule(build_schedule(g, c, p, costs, merge=False))
        assert res.iteration_time_s == pytest.approx(unmerged.iteration_time_s)
        assert res.peak_memory_bytes == pytest.approx(unmerged.peak_memory_bytes)
        peaks.append(res.peak_memory_bytes)
        times.append(res.iteration_time_s)
    b = devs[1]
    assert peaks[0][b] > peaks[1][b] > peaks[2][b], [p[b] for p in peaks]
    assert times[2] >= times[0]


def _pieces_tile_each_range(prog, p: Plan) -> None:
    counts = {r.device: r.accumulate for r in p.groups[0].replicas}
    seen: dict[tuple, list[tuple[int, int, int]]] = {}
    for d, lst in prog.instructions.items():
        for ins in lst:
            if isinstance(ins, Compute):
                seen.setdefault((d, ins.block, ins.phase, ins.microbatch), []).append((ins.piece, ins.lo, ins.hi))
    for (d, _b, _ph, _m), got in seen.items():
        assert [j for j, _, _ in got] == list(range(counts[d])), (d, got)
        assert all(got[j][2] == got[j + 1][1] for j in range(len(got) - 1)), got  # contiguous, in order


def test_random_accumulating_plans_lower_to_exactly_their_schedule():
    g, c, devs = _setup()
    rng = random.Random(11)
    for _ in range(12):
        used = rng.sample(devs, rng.randint(1, len(devs)))
        weights = [rng.uniform(0.2, 1.0) for _ in used]
        shares = [w / sum(weights) for w in weights]
        shares[-1] = 1.0 - sum(shares[:-1])
        p = _data_parallel(
            used,
            shares,
            [1] * len(used),
            groups=rng.choice([1, 2, 3]),
            batch=16,
            num_microbatches=rng.choice([1, 2]),
            schedule=rng.choice(["gpipe", "1f1b"]),
            bucket_bytes=rng.choice([150_000, 2**30]),
            sync=rng.choice(["ring", "tree"]),
        )
        least = [min(p.replica_samples(p.groups[0], m)[i] for m in range(p.num_microbatches)) for i in range(len(used))]
        p = _with_counts(p, [rng.randint(1, max(1, min(3, n))) for n in least]).validate(g, c)
        sched = build_schedule(g, c, p, TableCosts(g, c), merge=False)
        prog = to_program(sched, c)
        want = _expected_signatures(sched)
        for d in prog.devices:
            got = [_signature(i) for i in prog.instructions[d]]
            assert sorted(got) == sorted(want.get(d, [])), d
        _pieces_tile_each_range(prog, p)
