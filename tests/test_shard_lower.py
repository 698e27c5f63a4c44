"""Sharded state (ZeRO-1/2/3) in the plan, the costs, the lowering and the simulator.

- the plan's shard fields are validated with messages that say what to fix; they survive
  JSON, and a version-1 plan loads unsharded;
- the uneven ring reduce-scatter / all-gather time is the even one for even pieces and waits
  for the largest piece at every step;
- what each replica holds at the start of an iteration follows the ZeRO stage and its shard
  fraction (closed forms), and a stage-1 step is an all-reduce's traffic with the optimizer
  step cut to the piece (closed form);
- random sharded plans: every task of the simulator's schedule is one instruction per device
  it involves, the Program validates and round-trips through JSON, the shortcuts change
  nothing, a faster link never lengthens the iteration, and under stage 3 a gather comes
  before every compute of its block, whose end frees it;
- the Program's validator finds a compute that waits for a gather its device never launched.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from heterog.cost import comm
from heterog.errors import PlanError
from heterog.ir.kinds import CollectiveOp
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.lower.lowering import lower, to_program
from heterog.lower.program import Collective, Compute, Program
from heterog.lower.schedule import build_schedule
from heterog.lower.taskgraph import BWD, FWD, OPT, SYNC, XFER
from heterog.simulate.simulator import simulate, time_schedule
from tests.simulate_support import TableCosts, chain_graph, cluster, plan, with_link_bandwidth
from tests.test_simulate_properties import _random_plan

GF = 1e9
RATE = 1e12
PARAM = 2_000_000


class AdamCosts(TableCosts):
    """TableCosts with AdamW's state: two optimizer copies per parameter."""

    optimizer = "adamw"

    def persistent_bytes(self, nodes, device):
        return 4.0 * sum(self.g.node(n).param_bytes for n in nodes)

    def optimizer_state_bytes(self, nodes, device):
        return 2.0 * sum(self.g.node(n).param_bytes for n in nodes)


def _setup(n_layers: int = 8):
    g = chain_graph(n_layers, flops=GF, edge_bytes=2e5, param_bytes=PARAM)
    c = cluster([[RATE, 2 * RATE], [RATE], [0.5 * RATE, RATE]], nic_bandwidth=1e9, latency_s=1e-6)
    return g, c, [d.name for d in c.devices]


def _shard(p: Plan, stage: int, fractions: dict[str, float] | None = None) -> Plan:
    """Every replicated group of p sharded at `stage` (ring sync), with the given fractions
    (even where none are given)."""
    groups = []
    for gr in p.groups:
        if len(gr.replicas) < 2 or not stage:
            groups.append(gr)
            continue
        fr = [fractions[r.device] if fractions else 1 / len(gr.replicas) for r in gr.replicas]
        fr[-1] = 1.0 - sum(fr[:-1])
        reps = tuple(dataclasses.replace(r, shard=f) for r, f in zip(gr.replicas, fr))
        groups.append(dataclasses.replace(gr, replicas=reps, sync="ring", ps_device=None, shard_stage=stage))
    return dataclasses.replace(p, groups=tuple(groups)).validate()


def _unsharded(p: Plan) -> Plan:
    return dataclasses.replace(
        p,
        groups=tuple(
            dataclasses.replace(
                gr, shard_stage=0, replicas=tuple(dataclasses.replace(r, shard=None) for r in gr.replicas)
            )
            for gr in p.groups
        ),
    )


def _random_sharded_plan(rng: random.Random, devices, n_layers: int, batch: int) -> Plan:
    p = _random_plan(rng, devices, n_layers, batch)
    groups = []
    for gr in p.groups:
        stage = rng.choice([0, 1, 2, 3, 3]) if len(gr.replicas) > 1 else 0
        if not stage:
            groups.append(gr)
            continue
        weights = [rng.choice([0.0, 0.3, 1.0, 2.0]) for _ in gr.replicas]
        if not sum(weights):
            weights[0] = 1.0
        fr = [w / sum(weights) for w in weights]
        fr[-1] = 1.0 - sum(fr[:-1])
        reps = tuple(dataclasses.replace(r, shard=f) for r, f in zip(gr.replicas, fr))
        groups.append(dataclasses.replace(gr, replicas=reps, sync="ring", ps_device=None, shard_stage=stage))
    return dataclasses.replace(p, groups=tuple(groups)).validate()


# -- the plan -------------------------------------------------------------------------------
def _group(**kw) -> Group:
    base = dict(
        name="g",
        nodes=("l0",),
        replicas=(Replica(device="a", share=0.5, shard=0.25), Replica(device="b", share=0.5, shard=0.75)),
        sync="ring",
        shard_stage=3,
    )
    return Group(**{**base, **kw})


@pytest.mark.parametrize(
    "change,words",
    [
        (dict(shard_stage=4), "not one of 0"),
        (dict(shard_stage=0), "give shard fractions but shard_stage is 0"),
        (dict(sync="tree"), "set sync 'ring'"),
        (dict(replicas=(Replica(device="a", share=1.0, shard=1.0),)), "at least two replicas"),
        (
            dict(replicas=(Replica(device="a", share=0.5, shard=0.5), Replica(device="b", share=0.5))),
            r"replica\(s\) \['b'\] give no shard",
        ),
        (
            dict(replicas=(Replica(device="a", share=0.5, shard=0.5), Replica(device="b", share=0.5, shard=0.6))),
            "shard fractions sum to 1.1",
        ),
        (
            dict(replicas=(Replica(device="a", share=0.5, shard=-0.5), Replica(device="b", share=0.5, shard=1.5))),
            "shard must be ≥ 0",
        ),
    ],
)
def test_bad_shard_fields_name_the_group_and_the_fix(change, words):
    with pytest.raises(PlanError, match=words):
        _group(**change).validate()


def test_shard_fields_survive_json_and_a_version_1_plan_loads_unsharded():
    p = Plan(strategy="t", model=ModelSpec(name="mlp"), groups=(_group(),)).validate()
    again = Plan.from_json(p.to_json())
    assert again.groups[0].shard_stage == 3 and again.groups[0].shards == (0.25, 0.75)
    doc = json.loads(p.to_json())
    doc["version"] = 1
    doc["groups"][0]["replicas"] = [["a", 0.5], ["b", 0.5]]
    del doc["groups"][0]["shard_stage"]
    old = Plan.from_json(json.dumps(doc)).groups[0]
    assert old.shard_stage == 0 and old.shards == () and old.replicas[0].shard is None


# -- the collectives' time -------------------------------------------------------------------
def test_uneven_reduce_scatter_and_all_gather_times():
    c = cluster([[RATE, RATE, RATE, RATE]], intra_bandwidth=10e9, latency_s=1e-6)
    devs = [d.name for d in c.devices]
    n, nbytes = len(devs), 4e8
    for op in ("reduce_scatter", "all_gather"):
        even = comm.shard_collective_time_s(c, op, nbytes, devs, [0.25] * 4)
        assert even == pytest.approx(comm.ring_collective_time_s(c, op, nbytes, devs))
        # on a ring of equal links every step moves every piece but one: it waits for the largest
        uneven = comm.shard_collective_time_s(c, op, nbytes, devs, [0.4, 0.3, 0.2, 0.1])
        assert uneven == pytest.approx((n - 1) * (c.latency_s(devs[0], devs[1]) + 0.4 * nbytes / 10e9), rel=1e-9)


# -- what each replica holds -------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initial_state_per_replica_follows_the_stage_and_the_fraction(stage):
    g, c, devs = _setup()
    layers = [f"l{i}" for i in range(8)]
    reps = [(devs[0], 0.5), (devs[2], 0.3), (devs[3], 0.2)]
    fractions = {devs[0]: 0.1, devs[2]: 0.3, devs[3]: 0.6}
    p = _shard(plan([("all", layers, reps)], batch_size=10), stage, fractions)
    prog = lower(g, c, p, AdamCosts(g, c))
    params, opt = 8 * PARAM, 16 * PARAM  # parameters, AdamW state (gradients appear in backward)
    # the reduce-scatter's receive buffer: the largest piece a member is sent (in ring order
    # d0, d2, d3 a member is sent every piece but its predecessor's)
    received = {devs[0]: 0.3, devs[2]: 0.6, devs[3]: 0.6}
    for d, f in fractions.items():
        want = {0: params + opt, 1: params + f * opt, 2: params + f * opt, 3: f * (params + opt)}[stage]
        want += received[d] * 8 * PARAM if stage else 0.0
        assert prog.initial_bytes[d] == pytest.approx(want), (stage, d)


def test_a_stage_1_step_moves_an_allreduce_and_steps_one_piece():
    """Three like devices, one bucket, even pieces: reduce-scatter + all-gather move what the
    all-reduce moves, and the optimizer step takes a third of its time."""
    g = chain_graph(4, flops=GF, edge_bytes=2e5, param_bytes=PARAM)
    c = cluster([[RATE, RATE, RATE]], intra_bandwidth=10e9)
    devs = [d.name for d in c.devices]
    p = plan([("all", [f"l{i}" for i in range(4)], [(d, 1 / 3) for d in devs])], batch_size=12)
    costs = TableCosts(g, c, optimizer_s_per_byte=1e-9)
    t0 = simulate(g, c, p, costs).iteration_time_s
    t1 = simulate(g, c, _shard(p, 1), costs).iteration_time_s
    opt = 1e-9 * 4 * PARAM
    assert t1 == pytest.approx(t0 - opt * 2 / 3, rel=1e-9)


def test_sharding_lowers_the_peak_stage_by_stage():
    """Eight units: stage 3 holds two of them gathered at a time (one computing, one
    prefetched) beside its pieces. With two units it would hold both, more than stage 2."""
    g, c, devs = _setup()
    reps = [(devs[0], 0.5), (devs[2], 0.5)]
    p = plan([(f"g{i}", [f"l{i}"], reps) for i in range(8)], bucket_bytes=PARAM)  # a unit per layer
    peaks = [simulate(g, c, _shard(p, s), AdamCosts(g, c)).peak_memory_bytes[devs[0]] for s in range(4)]
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3], peaks


# -- random sharded plans -------------------------------------------------------------------------
def _signatures(sched) -> dict[str, list[tuple]]:
    """Per device, what each task of the schedule becomes there, in the schedule's order."""
    tasks, names = sched.tasks, sched.info.devices
    out: dict[str, list[tuple]] = {}
    for t in sched.order.tolist():
        k = tasks.kind[t]
        if k in (FWD, BWD):
            phase = "forward" if k == FWD else "backward"
            out.setdefault(names[tasks.dev[t]], []).append(("compute", tasks.block_of(t), phase, tasks.mb[t]))
        elif k == XFER:
            (src, dst), nbytes, _ = tasks.comm[t]
            out.setdefault(names[src], []).append(("send", t))
            out.setdefault(names[dst], []).append(("recv", t))
        elif k == SYNC:
            op = tasks.shard_ops.get(t)
            what = (op.primitive, op.phase, op.microbatch) if op else ("all-reduce", None, None)
            sig = ("collective", tasks.comm[t][2], *what)
            for d in tasks.comm[t][0]:
                out.setdefault(names[d], []).append(sig)
        elif k == OPT:
            out.setdefault(names[tasks.dev[t]], []).append(("optimizer",))
    return out


def _signature(i) -> tuple:
    if isinstance(i, Compute):
        return ("compute", i.block, str(i.phase), i.microbatch)
    if isinstance(i, Collective):
        return ("collective", i.block, str(i.primitive), str(i.phase) if i.phase else None, i.microbatch)
    if i.kind in ("send", "recv"):
        return (str(i.kind), i.tag)
    return ("optimizer",)


def test_random_sharded_programs_are_their_schedules_and_validate():
    g, c, devices = _setup()
    rng = random.Random(4)
    stages = set()
    for _ in range(30):
        p = _random_sharded_plan(rng, devices, 8, 16)
        stages |= {gr.shard_stage for gr in p.groups}
        costs = AdamCosts(g, c)
        sched = build_schedule(g, c, p, costs, merge=False)
        prog = to_program(sched, c)
        want = _signatures(sched)
        for d in prog.devices:
            got = [_signature(i) for i in prog.instructions[d]]
            assert sorted(got, key=repr) == sorted(want.get(d, []), key=repr), d
            assert [x for x in got if x[0] != "collective"] == [x for x in want[d] if x[0] != "collective"], d
            assert [x for x in got if x[0] == "collective"] == [x for x in want[d] if x[0] == "collective"], d
            _gathers_come_before_their_computes(prog, d, got)
        _gathered_parameters_live_until_their_compute_ends(sched)
        again = Program.from_json(json.dumps({"kind": "heterog.Program", "version": 2, **prog.to_dict()}))
        assert again.to_dict() == prog.to_dict()
    assert stages >= {0, 1, 2, 3}


def _gathers_come_before_their_computes(prog: Program, d: str, got: list[tuple]) -> None:
    for k, ins in enumerate(prog.instructions[d]):
        if isinstance(ins, Collective) and ins.serves is not None:
            b, phase, m = ins.serves
            compute = got.index(("compute", b, str(phase), m))
            assert k < compute and ins.alloc_bytes > 0, (d, ins.describe())
        if isinstance(ins, Collective) and ins.shards:
            assert len(ins.shards) == len(ins.members) and sum(ins.shards) == pytest.approx(1.0)


def _gathered_parameters_live_until_their_compute_ends(sched) -> None:
    tasks = sched.tasks
    src, dst = tasks.edges.arrays()
    succ: dict[int, list[int]] = {}
    for a, b in zip(src.tolist(), dst.tolist()):
        succ.setdefault(a, []).append(b)
    for t, op in tasks.shard_ops.items():
        if op.phase is None or op.primitive != "all-gather":
            continue
        nbytes = tasks.comm[t][1]
        served = [c for c in succ.get(t, []) if tasks.kind[c] in (FWD, BWD)]
        assert served, "a gather serves the computes of its block"
        for c in served:
            assert (tasks.dev[c], nbytes) in tasks.mem_start.of(t)
            assert (tasks.dev[c], -nbytes) in tasks.mem_end.of(c)


def test_random_sharded_plans_shortcuts_and_link_speed():
    """Symmetric devices simulated once change nothing; a faster link never slows a step."""
    g = chain_graph(6, flops=GF, edge_bytes=1e5, param_bytes=3_000_000)
    c = cluster([[RATE, RATE, 2 * RATE, 2 * RATE], [RATE, RATE, 2 * RATE, 2 * RATE]], nic_bandwidth=1e9)
    devices = [d.name for d in c.devices]
    rng = random.Random(8)
    for _ in range(12):
        p = _random_sharded_plan(rng, devices, 6, 24)
        if rng.random() < 0.5:  # even pieces on like devices: some devices are merged
            p = _shard(_unsharded(p), rng.choice([1, 2, 3]))
        costs = AdamCosts(g, c)
        fast = simulate(g, c, p, costs)
        slow = time_schedule(build_schedule(g, c, p, costs, merge=False))
        assert fast.iteration_time_s == pytest.approx(slow.iteration_time_s, rel=1e-12)
        assert fast.peak_memory_bytes == slow.peak_memory_bytes
        link = rng.choice(list(c.links))
        quicker = with_link_bandwidth(c, link, c.links[link].bandwidth_bytes_per_s * 4)
        after = simulate(g, quicker, p, AdamCosts(g, quicker)).iteration_time_s
        assert after <= fast.iteration_time_s * (1 + 1e-12)


def test_validation_finds_a_compute_whose_gather_was_never_launched():
    g, c, devs = _setup()
    layers = [f"l{i}" for i in range(8)]
    p = _shard(plan([("all", layers, [(devs[0], 0.5), (devs[2], 0.5)])]), 3)
    prog = lower(g, c, p, AdamCosts(g, c))
    doc = {"kind": "heterog.Program", "version": 2, **prog.to_dict()}
    lst = doc["instructions"][devs[0]]
    k = next(
        i for i, x in enumerate(lst) if x["kind"] == "collective" and x["primitive"] == str(CollectiveOp.ALL_GATHER)
    )
    lst.append(lst.pop(k))  # launched at the very end, after the compute it serves
    with pytest.raises(PlanError, match="deadlocks.*waiting for its parameters"):
        Program.from_json(json.dumps(doc))


def test_each_member_receives_at_most_the_largest_piece_but_its_predecessors():
    import random

    from heterog.lower.shard_tasks import largest_received

    rng = random.Random(0)
    for n in (1, 2, 3, 7, 40):
        for _ in range(20):
            fr = tuple(rng.choice([0.0, 0.25, rng.random()]) for _ in range(n))
            want = [max((fr[j] for j in range(n) if j != (i - 1) % n), default=0.0) for i in range(n)]
            assert largest_received(fr) == want
