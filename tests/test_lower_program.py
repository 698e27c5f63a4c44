"""The Program: one schedule that the simulator times and the executor carries out.

- every task of the simulator's schedule is exactly one instruction per device it involves,
  and every instruction comes from one task (random plans: data, hybrid, pipeline GPipe and
  1F1B, parameter servers);
- the Program validates, survives JSON, and its validator catches what would hang a run;
- 1F1B keeps at most p − s micro-batches in flight on stage s;
- every instruction has an id (its op and device) that the simulation of its schedule
  carries on exactly one event;
- on real gloo processes, what each rank executes, recorded as it runs, is its Program, and
  every span a rank measures that times an instruction names exactly one instruction of it:
  each instruction one span per step, joined in the run's result with its prediction.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest

from heterog.errors import PlanError
from heterog.ir.kinds import Phase
from heterog.ir.run_request import Limits, PredictionConfig
from heterog.lower.lowering import lower, to_program
from heterog.lower.program import Collective, Compute, Optimizer, Program, Recv, Send, instruction_id
from heterog.lower.schedule import build_schedule
from heterog.lower.taskgraph import BWD, FWD, OPT, SYNC, XFER
from heterog.simulate.simulator import time_schedule
from tests.plan_batch import batch_options
from tests.simulate_support import TableCosts, chain_graph, cluster, plan
from tests.test_simulate_properties import _random_plan

GF = 1e9
RATE = 1e12


def _setup():
    g = chain_graph(8, flops=GF, edge_bytes=2e5, param_bytes=2_000_000)
    c = cluster([[RATE, 2 * RATE], [RATE], [0.5 * RATE, RATE]], nic_bandwidth=1e9, latency_s=1e-6)
    return g, c, [d.name for d in c.devices]


def _expected_signatures(sched) -> dict[str, list[tuple]]:
    """Per device, the instruction each task of the schedule stands for, in the schedule's order."""
    tasks, names = sched.tasks, sched.info.devices
    out: dict[str, list[tuple]] = {}
    for t in sched.order.tolist():
        k = tasks.kind[t]
        if k in (FWD, BWD):
            out.setdefault(names[tasks.dev[t]], []).append(
                ("compute", tasks.block_of(t), "forward" if k == FWD else "backward", tasks.mb[t])
            )
        elif k == XFER:
            (src, dst), nbytes, _ = tasks.comm[t]
            out.setdefault(names[src], []).append(("send", t, names[dst], nbytes))
            out.setdefault(names[dst], []).append(("recv", t, names[src], nbytes))
        elif k == SYNC:
            for d in tasks.comm[t][0]:
                out.setdefault(names[d], []).append(("collective", tasks.comm[t][2]))
        elif k == OPT:
            out.setdefault(names[tasks.dev[t]], []).append(("optimizer",))
    return out


def _signature(i) -> tuple:
    if isinstance(i, Compute):
        return ("compute", i.block, str(i.phase), i.microbatch)
    if isinstance(i, Send):
        return ("send", i.tag, i.peer, i.nbytes)
    if isinstance(i, Recv):
        return ("recv", i.tag, i.peer, i.nbytes)
    if isinstance(i, Collective):
        return ("collective", i.block)
    return ("optimizer",)


def _own_inputs(sched, d: str) -> dict[int, list[tuple]]:
    """Per sync block, the signatures of the instructions on device d that feed it."""
    tasks, names = sched.tasks, sched.info.devices
    src, dst = tasks.edges.arrays()
    out: dict[int, list[tuple]] = {}
    for a, b in zip(src.tolist(), dst.tolist()):
        if tasks.kind[b] == SYNC and tasks.kind[a] in (FWD, BWD) and names[tasks.dev[a]] == d:
            out.setdefault(tasks.comm[b][2], []).append(
                ("compute", tasks.block_of(a), "forward" if tasks.kind[a] == FWD else "backward", tasks.mb[a])
            )
    return out


def test_the_simulators_tasks_are_exactly_the_programs_instructions():
    """Each device runs its projection of the schedule's order, but for its collectives: each
    is launched as soon as this device's own inputs of it are done, collectives in one order."""
    g, c, devices = _setup()
    rng = random.Random(3)
    kinds, moved = set(), 0
    for _ in range(40):
        p = _random_plan(rng, devices, 8, 16)
        costs = TableCosts(g, c)
        sched = build_schedule(g, c, p, costs, merge=False)
        prog = to_program(sched, c)
        want = _expected_signatures(sched)
        for d in prog.devices:
            got = [_signature(i) for i in prog.instructions[d]]
            projection = want.get(d, [])
            assert sorted(got) == sorted(projection), d  # the same instructions
            assert [x for x in got if x[0] != "collective"] == [x for x in projection if x[0] != "collective"], d
            assert [x for x in got if x[0] == "collective"] == [x for x in projection if x[0] == "collective"], d
            inputs = _own_inputs(sched, d)
            for k, x in enumerate(got):
                if x[0] != "collective" or not inputs.get(x[1]):
                    continue
                before = got[:k]
                assert set(inputs[x[1]]) <= set(before), (d, x)  # after its own inputs
                assert before[-1] in inputs[x[1]] or before[-1][0] == "collective", (d, x, before[-1])
            moved += got != projection
        kinds.add(
            (
                p.schedule,
                p.num_microbatches > 1,
                any(gr.sync == "ps" for gr in p.groups),
                len({gr.replicas for gr in p.groups}) > 1,
            )
        )
    assert len(kinds) >= 6, kinds  # pipelines, micro-batches, servers and hybrids all drawn
    assert moved, "no random plan launched a collective before its place in the global order"


def test_a_replica_launches_its_sync_before_its_next_backward():
    """Two like replicas end a block's backward at the same time: the global order lists the
    sync after one of them has started its next backward; that replica must not wait for it
    (the simulator overlaps the sync with that backward)."""
    g, c, devices = _setup()
    half = [f"l{i}" for i in range(4)], [f"l{i}" for i in range(4, 8)]
    p = plan(
        [
            ("a", half[0], [(devices[0], 0.5), (devices[2], 0.5)]),
            ("b", half[1], [(devices[0], 0.5), (devices[2], 0.5)]),
        ],
        batch_size=8,
        sync="ring",
    )
    p = dataclasses.replace(p, bucket_bytes=8_000_000)  # a bucket per group: two syncs
    prog = lower(g, c, p, TableCosts(g, c))
    for d in (devices[0], devices[2]):
        got = [_signature(i) for i in prog.instructions[d]]
        assert got.index(("collective", 1)) == got.index(("compute", 1, "backward", 0)) + 1, (d, got)
        assert got.index(("collective", 1)) < got.index(("compute", 0, "backward", 0)), (d, got)


def test_every_random_program_validates_and_round_trips_through_json():
    g, c, devices = _setup()
    rng = random.Random(9)
    for _ in range(25):
        p = _random_plan(rng, devices, 8, 16)
        prog = lower(g, c, p, TableCosts(g, c))
        text = json.dumps({"kind": "heterog.Program", "version": 2, **prog.to_dict()})
        again = Program.from_json(text)
        assert again.to_dict() == prog.to_dict()
        for lst in prog.instructions.values():  # sample ranges stay inside micro-batches
            for i in lst:
                if isinstance(i, (Compute, Send, Recv)):
                    assert 0 <= i.lo <= i.hi <= prog.microbatch_sizes[i.microbatch]


def _two_stage(schedule="gpipe", microbatches=2):
    g, c, devices = _setup()
    half = [f"l{i}" for i in range(4)], [f"l{i}" for i in range(4, 8)]
    p = plan(
        [("a", half[0], [(devices[0], 0.5), (devices[1], 0.5)]), ("b", half[1], [(devices[2], 1.0)])],
        batch_size=8,
        num_microbatches=microbatches,
        schedule=schedule,
        sync="ring",
    )
    return lower(g, c, p, TableCosts(g, c))


def _tamper(prog: Program, device: str, fn) -> dict:
    doc = {"kind": "heterog.Program", "version": 2, **prog.to_dict()}
    doc["instructions"][device] = fn(doc["instructions"][device])
    return doc


def test_validation_names_an_unmatched_send():
    prog = _two_stage()
    src = next(d for d, lst in prog.instructions.items() if any(isinstance(i, Send) for i in lst))
    doc = _tamper(prog, src, lambda lst: [i for i in lst if i["kind"] != "send"])
    with pytest.raises(PlanError, match="no matching send"):
        Program.from_json(json.dumps(doc))


def test_validation_finds_a_deadlock():
    """A receive of a backward gradient moved before the forward its peer needs first leaves
    both waiting on each other; the untouched program validates."""
    prog = _two_stage()
    src = prog.devices[0]

    Program.from_json(json.dumps(_tamper(prog, src, lambda lst: lst)))

    def early_recv(lst):
        lst = list(lst)
        k = max(k for k, i in enumerate(lst) if i["kind"] == "recv")  # a backward gradient
        lst.insert(0, lst.pop(k))
        return lst

    with pytest.raises(PlanError, match="deadlocks"):
        Program.from_json(json.dumps(_tamper(prog, src, early_recv)))


def test_one_f_one_b_keeps_at_most_p_minus_s_micro_batches_in_flight():
    g = chain_graph(8, flops=GF, edge_bytes=2e5, param_bytes=1_000_000)
    c = cluster([[RATE, RATE, RATE, RATE]], nic_bandwidth=1e9)
    devs = [d.name for d in c.devices]
    stages = [(f"s{k}", [f"l{2 * k}", f"l{2 * k + 1}"], [(devs[k], 1.0)]) for k in range(4)]
    p = plan(stages, batch_size=16, num_microbatches=8, schedule="1f1b", sync="ring")
    prog = lower(g, c, p, TableCosts(g, c))
    for s, d in enumerate(devs):
        live, peak = set(), 0
        for i in prog.instructions[d]:
            if isinstance(i, Compute):
                (live.add if i.phase == Phase.FORWARD else live.discard)(i.microbatch)
                peak = max(peak, len(live))
        assert peak == min(4 - s, 8), (d, peak)
    gpipe = lower(g, c, dataclasses.replace(p, schedule="gpipe"), TableCosts(g, c))
    first = [i for i in gpipe.instructions[devs[0]] if isinstance(i, Compute)]
    assert [i.phase for i in first[:8]] == [Phase.FORWARD] * 8  # GPipe: all forwards first


def test_every_instruction_has_one_id_and_one_simulated_event():
    """An instruction's id (op@device) is unique in its Program, and the simulation of the
    schedule the Program was written from has exactly one event of that op on that device's
    track — and no event on a device's track that is not one of its instructions."""
    from heterog.runs.summary import predicted_spans

    g, c, devices = _setup()
    rng = random.Random(5)
    for _ in range(12):
        p = _random_plan(rng, devices, 8, 16)
        sched = build_schedule(g, c, p, TableCosts(g, c), merge=False)
        prog, sim = to_program(sched, c), time_schedule(sched, timeline=False)
        where = prog.locations()
        assert len(where) == sum(len(v) for v in prog.instructions.values())  # no id twice
        events = Counter((e.op, e.track) for e in sim.events if e.track in prog.instructions)
        want = {(ins.op, d) for d, lst in prog.instructions.items() for ins in lst}
        assert set(events) == want and set(events.values()) == {1}
        assert all(ident == instruction_id(d, prog.instructions[d][i].op) for ident, (d, i) in where.items())
        # as a rank's executor times them: every instruction within the iteration, in order
        spans = predicted_spans(prog, sim)
        assert set(spans) == set(where.values())
        assert all(0.0 <= a <= b <= sim.iteration_time_s + 1e-12 for a, b in spans.values())


def test_summary_counts_instructions_bytes_and_the_programs_peak():
    prog = _two_stage(microbatches=2)
    summary = prog.summary()
    for d, s in summary.items():
        lst = prog.instructions[d]
        assert s["instructions"]["compute"] == sum(isinstance(i, Compute) for i in lst)
        assert s["sent_bytes"] == sum(i.nbytes for i in lst if isinstance(i, Send))
        assert s["peak_memory_bytes"] >= prog.initial_bytes[d] > 0
    assert summary[prog.devices[-1]]["received_bytes"] > 0
    assert all(isinstance(prog.instructions[d][-1], Optimizer) for d in prog.devices)


# -- the executor carries out the Program, op by op ------------------------------------------
MODELS = "tests/test_execute_models.py"


# the random plans below run in one launch, predicted, so that their results join both sides
BATCH_RUN = batch_options(steps=2, limits=Limits(timeout_s=60), prediction=PredictionConfig())


def _executed_matches_program(done):
    from heterog.ir.plan import Plan

    p, out, tmp_path = done.plan, done.result(), done.out_dir
    prog = Program.load(tmp_path / "program.json")
    assert Plan.from_dict(prog.plan).groups[0].name == p.groups[0].name
    for rank, d in enumerate(out.devices):
        ran = [tuple(x) for x in json.loads((tmp_path / f"executed_rank{rank}.json").read_text())]
        want = []
        for i in prog.instructions[d]:
            if isinstance(i, Compute):
                want.append(("compute", i.block, str(i.phase), i.microbatch, i.hi - i.lo))
            elif isinstance(i, (Send, Recv)):
                want.append((str(i.kind), str(i.phase), i.tag, i.peer, i.hi - i.lo))
            elif isinstance(i, Collective):
                want.append(("collective", i.block, str(i.method), list(i.members)))
            else:
                want.append(("optimizer",))
        ran = [tuple(list(x) if isinstance(x, list) else x for x in r) for r in ran]
        assert ran == [tuple(w) for w in want], d
        # samples really computed: recorded from the tensors, not the instruction
        samples = json.loads((tmp_path / f"samples_rank{rank}.json").read_text())
        assert samples == [
            i.hi - i.lo
            for i in prog.instructions[d]
            if isinstance(i, Compute) and i.phase == Phase.FORWARD and i.hi > i.lo
        ]


def random_plan_of_kind(kind: str):
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    rng = random.Random(kind)
    nodes = ("fc1", "act1", "fc2", "act2", "fc3")
    cut = rng.randint(1, 4)

    def reps(*pairs):
        return tuple(Replica(device=d, share=s) for d, s in pairs)

    uneven = rng.uniform(0.2, 0.45)
    if kind == "data":
        groups = [Group(name="all", nodes=nodes, replicas=reps(("a", uneven), ("b", 1 - uneven)), sync="ring")]
    elif kind == "hybrid":
        groups = [
            Group(name="front", nodes=nodes[:cut], replicas=reps(("a", uneven), ("b", 1 - uneven)), sync="tree"),
            Group(name="back", nodes=nodes[cut:], replicas=reps(("b", 0.5), ("c", 0.5)), sync="hierarchical"),
        ]
    elif kind in ("gpipe", "1f1b"):
        groups = [
            Group(name="s0", nodes=nodes[:cut], replicas=reps(("a", 1.0))),
            Group(name="s1", nodes=nodes[cut:], replicas=reps(("b", uneven), ("c", 1 - uneven)), sync="ring"),
        ]
    else:
        groups = [
            Group(name="all", nodes=nodes, replicas=reps(("a", uneven), ("b", 1 - uneven)), sync="ps", ps_device="c")
        ]
    return Plan(
        strategy="test",
        model=ModelSpec(name=f"{MODELS}:mlp", batch_size=12),
        groups=tuple(groups),
        num_microbatches=3 if kind in ("gpipe", "1f1b") else 1,
        schedule="1f1b" if kind == "1f1b" else "gpipe",
    ).validate()


@pytest.mark.slow
@pytest.mark.batched(plan=random_plan_of_kind)
@pytest.mark.parametrize("kind", ["data", "hybrid", "gpipe", "1f1b", "ps"])
def test_each_rank_executes_exactly_its_program(plan_batch, kind):
    _executed_matches_program(plan_batch.get(random_plan_of_kind, kind=kind))


# the span that times an instruction, by the instruction's kind (and a compute's phase)
SPAN_OF = {"forward": "forward", "backward": "backward", "send": "transfer", "recv": "transfer"}
SPAN_OF.update(collective="collective", optimizer="optimizer")


@pytest.mark.slow
@pytest.mark.batched(plan=random_plan_of_kind)
@pytest.mark.parametrize("kind", ["data", "hybrid", "gpipe", "1f1b", "ps"])
def test_each_measured_span_is_one_program_instruction(plan_batch, kind):
    """Every span a rank measured either times exactly one instruction of its Program (index
    and op agree, the span's category is the instruction's) or is the executor's own (the
    step, waits for syncs); each instruction has exactly one span per step; and the run's
    result joins every instruction, by id, with its prediction."""
    from heterog.execute.spec import RankResult
    from heterog.ir.run_result import SpanCategory

    done = plan_batch.get(random_plan_of_kind, kind=kind)
    result, prog = done.result(), Program.load(done.out_dir / "program.json")
    for rank, d in enumerate(result.devices):
        ran = RankResult.load(RankResult.path(done.out_dir, rank))
        lst, per_step = prog.instructions[d], Counter()
        for s in ran.spans:
            if s.index is None:
                assert s.op is None and s.category in (SpanCategory.STEP, SpanCategory.SYNC), s
                continue
            ins = lst[s.index]
            label = str(ins.phase) if isinstance(ins, Compute) else str(ins.kind)
            assert s.op == ins.op and s.category == SPAN_OF[label], (s, ins)
            per_step[(s.step, s.index)] += 1
        assert set(per_step.values()) == {1}
        assert set(per_step) == {(rec.step, i) for rec in ran.steps for i in range(len(lst))}
    assert sorted(i.id for i in result.instructions) == sorted(prog.locations())
    assert all(i.predicted_s is not None and i.measured_s is not None for i in result.instructions)
    assert {r.kind for r in result.by_kind()} >= {"forward", "backward", "optimizer"}


def test_cli_lower_prints_per_device_counts_and_writes_a_program_simulate_accepts(tmp_path):
    from typer.testing import CliRunner

    from heterog.cli.main import app
    from heterog.hardware.spec import cluster_to_dict, load_cluster
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    c = load_cluster("emulated-4")
    devs = [d.name for d in c.devices]
    p = Plan(
        strategy="test",
        model=ModelSpec(name="mlp", batch_size=16),
        groups=(
            Group(
                name="all",
                nodes=("0", "1", "2", "3", "4", "loss::_log_softmax@0"),
                sync="ring",
                replicas=tuple(Replica(device=d, share=0.25) for d in devs),
            ),
        ),
        cluster=cluster_to_dict(c),
    ).validate()
    p.save(tmp_path / "plan.json")
    runner = CliRunner()
    r = runner.invoke(app, ["lower", str(tmp_path / "plan.json"), "--json", "--out", str(tmp_path / "prog.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert set(doc["devices"]) == set(devs)
    assert all(s["instructions"]["collective"] == 1 and s["sent_bytes"] == 0 for s in doc["devices"].values())
    prog = Program.load(tmp_path / "prog.json")
    a = runner.invoke(app, ["simulate", str(tmp_path / "prog.json"), "--json"])
    b = runner.invoke(app, ["simulate", str(tmp_path / "plan.json"), "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert json.loads(a.output)["iteration_time_s"] == json.loads(b.output)["iteration_time_s"]
    assert prog.devices == tuple(devs)


@pytest.mark.slow
def test_simulate_and_run_predict_the_same_time_for_one_emulated_plan(tmp_path):
    """One prediction per plan: `heterog simulate` and the prediction `heterog run` prints
    come from the same inputs (pipeline.plan_inputs) and the same schedule."""
    import subprocess
    import sys

    from heterog.hardware.spec import cluster_to_dict, load_cluster
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    c = load_cluster("emulated-4")
    devs = [d.name for d in c.devices]
    p = Plan(
        strategy="test",
        model=ModelSpec(name="toy-cnn", batch_size=24),
        groups=(
            Group(
                name="all",
                nodes=_toy_nodes(),
                sync="ring",
                replicas=tuple(Replica(device=d, share=s) for d, s in zip(devs, (0.3, 0.3, 0.2, 0.2))),
            ),
        ),
        cluster=cluster_to_dict(c),
    ).validate()
    p.save(tmp_path / "plan.json")

    def cli(*args):
        r = subprocess.run(
            [sys.executable, "-m", "heterog.cli.main", *args, "--json"], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    sim = cli("simulate", str(tmp_path / "plan.json"))
    ran = cli("run", str(tmp_path / "plan.json"), "--steps", "2", "--no-shaping")
    assert ran["predicted_iteration_time_s"] == pytest.approx(sim["iteration_time_s"], rel=1e-9)


def _toy_nodes() -> tuple[str, ...]:
    from heterog.capture import capture_model

    return tuple(n.name for n in capture_model("toy-cnn", batch_size=4).nodes)


def test_a_tied_weight_split_across_devices_costs_each_holder_a_copy():
    """The executor gives every device that reads a tied parameter outside its owner's
    placement a copy (parameter, gradient, optimizer state); the simulator counts it there."""
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica
    from heterog.simulate import simulate

    args = dict(vocab=96, d_model=32, heads=4, layers=1, ffn=64, dropout=0.0)
    g = capture_model("transformer", args, batch_size=4, seq_len=8)
    assert g.ties, "the zoo transformer ties its embedding and output projection"
    c = load_cluster("paper-8gpu")
    a, b = (d.name for d in c.devices[:2])
    names = [n.name for n in g.nodes]
    k = len(names) // 2
    p = Plan(
        strategy="t",
        model=ModelSpec(name="transformer", args=args, batch_size=4, seq_len=8),
        optimizer="adamw",
        groups=(
            Group(name="front", nodes=tuple(names[:k]), replicas=(Replica(device=a, share=1.0),)),
            Group(name="back", nodes=tuple(names[k:]), replicas=(Replica(device=b, share=1.0),)),
        ),
    ).validate()
    costs = build_cost_model(g, c, optimizer="adamw")
    tied = simulate(g, c, p, costs)
    untied = simulate(
        dataclasses.replace(g, ties=()), c, p, build_cost_model(dataclasses.replace(g, ties=()), c, optimizer="adamw")
    )
    extra = sum(
        costs.tied_copy_bytes(t.param_bytes, b) for t in g.ties if {n in names[k:] for n in t.nodes} == {True, False}
    )
    assert extra > 0
    assert tied.persistent_memory_bytes[b] - untied.persistent_memory_bytes[b] == pytest.approx(extra, abs=1)
    assert tied.persistent_memory_bytes[a] == untied.persistent_memory_bytes[a]


def test_a_split_tied_weight_gets_its_own_gradient_all_reduce_over_the_holders():
    """The executor leaves a tied parameter whose users lie in several groups out of its
    owner's bucket and all-reduces its copies' gradients over every holder: the schedule has
    that sync task (timed, before each holder's optimizer step), the Program its Collective."""
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica

    args = dict(vocab=96, d_model=32, heads=4, layers=1, ffn=64, dropout=0.0)
    g = capture_model("transformer", args, batch_size=4, seq_len=8)
    c = load_cluster("paper-8gpu")
    a, b, e = (d.name for d in c.devices[:3])
    names = [n.name for n in g.nodes]
    k = len(names) // 2
    p = Plan(
        strategy="t",
        model=ModelSpec(name="transformer", args=args, batch_size=4, seq_len=8),
        groups=(
            Group(
                name="front",
                nodes=tuple(names[:k]),
                sync="ring",
                replicas=(Replica(device=a, share=0.5), Replica(device=e, share=0.5)),
            ),
            Group(name="back", nodes=tuple(names[k:]), replicas=(Replica(device=b, share=1.0),)),
        ),
    ).validate()
    costs = build_cost_model(g, c)
    sched = build_schedule(g, c, p, costs)
    tasks, info = sched.tasks, sched.info
    (tie,) = g.ties
    (s,) = [t for t, name in tasks.ties.items() if name == tie.param]
    assert set(info.names(tasks.comm[s][0])) == {a, b, e} and tasks.comm[s][1] == tie.param_bytes
    assert tasks.dur[s] > 0
    opt = {info.devices[tasks.dev[t]]: t for t in range(len(tasks.kind)) if tasks.kind[t] == OPT}
    assert all(opt[d] in tasks.successors(s) for d in (a, b, e))
    # the owner's bucket (front, replicated on a and e) syncs its gradients without the tie
    (bucket,) = [t for t in range(len(tasks.kind)) if tasks.kind[t] == SYNC and t not in tasks.ties]
    front = sum(costs.gradient_bytes(nodes) for nodes in sched.blocks[tasks.comm[bucket][2]].nodes)
    assert tasks.comm[bucket][1] == pytest.approx(front - tie.param_bytes)
    prog = to_program(sched, c)
    ties = {d: [i for i in prog.instructions[d] if isinstance(i, Collective) and i.tie] for d in (a, b, e)}
    assert all(len(v) == 1 and v[0].tie == tie.param and set(v[0].members) == {a, b, e} for v in ties.values())
    Program.from_json(json.dumps({"kind": "heterog.Program", "version": 2, **prog.to_dict()}))


def test_a_parameter_server_holds_the_optimizer_state_and_its_replicas_do_not():
    """HeteroG's PS as the executor runs it: the server keeps a copy of the parameters, the
    optimizer state and a buffer for the summed gradient; the replicas keep parameters,
    gradients and the buffer the new parameters arrive in (every buffer kept from step to
    step, execute/collectives.py ParameterServer)."""
    from heterog.capture import capture_model
    from heterog.cost import build_cost_model
    from heterog.hardware.spec import load_cluster
    from heterog.ir.plan import Group, ModelSpec, Plan, Replica
    from heterog.simulate import simulate

    g = capture_model("mlp", batch_size=8)
    c = load_cluster("paper-8gpu")
    a, b, s = (d.name for d in c.devices[:3])
    nodes = tuple(n.name for n in g.nodes)
    costs = build_cost_model(g, c, optimizer="adamw")

    def ps_plan(server):
        return Plan(
            strategy="t",
            model=ModelSpec(name="mlp", batch_size=8),
            optimizer="adamw",
            groups=(
                Group(
                    name="all",
                    nodes=nodes,
                    sync="ps",
                    ps_device=server,
                    replicas=(Replica(device=a, share=0.5), Replica(device=b, share=0.5)),
                ),
            ),
        ).validate()

    state = costs.optimizer_state_bytes(nodes, a)
    full = costs.persistent_bytes(nodes, a)
    assert state > 0
    grad = costs.gradient_bytes(nodes)
    r = simulate(g, c, ps_plan(s), costs)
    assert r.persistent_memory_bytes[a] == pytest.approx(full - state + grad)
    assert r.persistent_memory_bytes[s] == pytest.approx(full)
    r = simulate(g, c, ps_plan(a), costs)  # the server is also a replica
    assert r.persistent_memory_bytes[b] == pytest.approx(full - state + grad)
    assert r.persistent_memory_bytes[a] == pytest.approx(2 * full - state)
