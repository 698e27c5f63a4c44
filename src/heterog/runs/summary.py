"""The ranks' results of one run → a RunResult, the prediction of the same schedule beside
each measurement: per step, per rank, and per Program instruction.

The join of prediction and measurement is by instruction id (lower/program.py
instruction_id): a simulated event of op t on device d's track, and the span that rank r
(running device d) measured for its instruction at index i, whose op is t. Every span that
times an instruction must name one that exists, and every instruction has exactly one such
span per step, per accumulated batch for computes, transfers and a stage-3 sharded block's
collectives (`instruction_spans` checks both); the simulation's events cover every
instruction of the Program it was written with (orchestrate.lowered).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from heterog.execute.spec import RankResult
from heterog.execute.steplog import merge
from heterog.ir.kinds import InstructionKind
from heterog.ir.run_request import RunOptions
from heterog.ir.run_result import (
    InstructionTiming,
    LinkShapingRecord,
    RankSummary,
    Repetition,
    RunResult,
    Span,
    SpanCategory,
    StepRecord,
)
from heterog.lower.program import Collective, Compute, Optimizer, Program, Recv, Send, instruction_id
from heterog.orchestrate import Lowered
from heterog.simulate.result import SimResult


def measured_records(result: RankResult, warmup_steps: int) -> tuple[StepRecord, ...]:
    """The rank's steps that count in the timing: all but the first `warmup_steps` (all of
    them when the run has no more)."""
    first = warmup_steps if len(result.steps) > warmup_steps else 0
    return result.steps[first:]


def _rank_summary(r: RankResult, measured: Sequence[StepRecord], sim_devices: dict[str, dict]) -> RankSummary:
    def med(values) -> float:
        return statistics.median(values)

    predicted = sim_devices.get(r.device, {})
    return RankSummary(
        rank=r.rank,
        device=r.device,
        slowdown=r.slowdown,
        cores=r.cores,
        groups=r.groups,
        step_time_s=med(s.step_time_s for s in measured),
        compute_s=med(s.compute_s for s in measured),
        cpu_s=med(s.cpu_s for s in measured),
        paced_s=med(s.paced_s for s in measured),
        recv_wait_s=med(s.recv_wait_s for s in measured),
        sync_s=med(s.sync_s for s in measured),
        other_s=med(s.other_s for s in measured),
        sent_bytes_total=r.sent_bytes,
        max_rss_bytes=r.max_rss_bytes,
        torch_device=r.torch_device,
        backend=r.backend,
        peak_allocated_bytes=r.peak_allocated_bytes,
        peak_reserved_bytes=r.peak_reserved_bytes,
        peak_live_bytes=r.peak_live_bytes,
        memory_cap_bytes=r.memory_cap_bytes,
        skipped_steps=r.steps[-1].skipped_steps if r.steps else 0,
        predicted_compute_s=predicted.get("compute_time_s"),
        predicted_communication_s=predicted.get("communication_time_s"),
        predicted_peak_memory_bytes=predicted.get("peak_memory_bytes"),
    )


def repetition(results: Sequence[RankResult], warmup_steps: int, sim: SimResult | None) -> Repetition:
    """One run's ranks summarised: the median iteration (the slowest rank's step) over the
    measured steps, every step's loss, each rank's medians beside the simulator's figures."""
    measured = [measured_records(r, warmup_steps) for r in results]
    per_step = [max(m[k].step_time_s for m in measured) for k in range(len(measured[0]))]
    steps = len(results[0].steps)
    sim_devices = sim.to_dict().get("devices", {}) if sim is not None else {}
    first = results[0]
    scales = tuple(s.loss_scale for s in first.steps)
    trained = first.training is not None  # the training options that ran (execute/train_loop.py)
    return Repetition(
        measured_iteration_time_s=statistics.median(per_step),
        measured_steps=len(per_step),
        losses=tuple(sum(r.steps[k].loss for r in results) for k in range(steps)),
        per_rank=tuple(_rank_summary(r, m, sim_devices) for r, m in zip(results, measured)),
        loss_scales=tuple(float(s) for s in scales if s is not None) if scales and scales[0] is not None else None,
        training=first.training,
        learning_rates=tuple(s.lr for s in first.steps) if trained else None,
        grad_norms=tuple(s.grad_norm for s in first.steps) if trained else None,
        evaluations=first.evaluations,
    )


def instruction_spans(
    program: Program, results: Sequence[RankResult], passes: int = 1
) -> dict[tuple[int, int, int], Span]:
    """(rank, step, index) → the span that timed instruction `index` of the rank's list in that
    step. With `passes` batches accumulated per step (--accumulate), computes and transfers
    run once per batch (so do a stage-3 sharded block's gathers and reduce-scatters) and the
    other syncs and the optimizer once: the last pass's span (the pass
    that runs the whole Program, as predicted) stands for the instruction. Raises
    AssertionError when a span names no instruction of the Program (an index past the list,
    another op) or an instruction has another number of spans in a step than that."""
    out: dict[tuple[int, int, int], Span] = {}
    for r in results:
        lst = program.instructions[r.device]
        count: dict[tuple[int, int, int], int] = {}
        for s in r.spans:
            if s.index is None:
                continue
            assert 0 <= s.index < len(lst) and lst[s.index].op == s.op, (
                f"rank {r.rank}: span {s.name!r} names instruction {s.index} (op {s.op}), which {r.device}'s "
                f"Program list does not hold"
            )
            key = (r.rank, s.step, s.index)
            count[key] = count.get(key, 0) + 1
            out[key] = s
        for rec in r.steps:
            for i, ins in enumerate(lst):
                # a stage-3 sharded block's gathers and reduce-scatters run with its computes
                once = isinstance(ins, Optimizer) or (isinstance(ins, Collective) and ins.phase is None)
                want = 1 if once else passes
                got = count.get((r.rank, rec.step, i), 0)
                assert got == want, f"rank {r.rank}, step {rec.step}: instruction {i} has {got} spans, not {want}"
    return out


def shown_step(results: Sequence[RankResult], warmup_steps: int) -> int:
    """The step whose iteration time is the median of the measured steps (the lower one of
    an even count): the step a timeline shows."""
    measured = [measured_records(r, warmup_steps) for r in results]
    times = {m.step: max(ms[k].step_time_s for ms in measured) for k, m in enumerate(measured[0])}
    median = statistics.median_low(sorted(times.values()))
    return next(step for step, t in times.items() if t == median)


def predicted_spans(program: Program, sim: SimResult) -> dict[tuple[str, int], tuple[float, float]]:
    """(device, index) → each instruction's predicted span as its rank's executor measures
    it (runtime.py), read off the simulated schedule: a compute or the optimizer step its
    simulated task; a collective its simulated run; a send its posting, which the simulator
    does not time (zero at the moment the rank reaches it); a receive its wait, from the moment
    the rank reaches it — the end of the instruction before it that held the rank — until its
    transfer's simulated end."""
    event = {(e.op, e.track): (float(e.start_s), float(e.end_s)) for e in sim.events}
    out: dict[tuple[str, int], tuple[float, float]] = {}
    for d, lst in program.instructions.items():
        reached = 0.0  # when the rank's main thread gets to the next instruction
        for i, ins in enumerate(lst):
            start, end = event[(ins.op, d)]
            if isinstance(ins, Send):
                start = end = reached
            elif isinstance(ins, Recv):
                start, end = reached, max(reached, end)
            if not isinstance(ins, (Send, Collective)):
                reached = max(reached, end)
            out[(d, i)] = (start, end)
    return out


def instruction_timings(
    program: Program, sim: SimResult | None, results: Sequence[RankResult], warmup_steps: int, passes: int = 1
) -> tuple[tuple[InstructionTiming, ...], int]:
    """Every instruction of the Program, predicted (its simulated event) beside measured (the
    median duration of its span over the measured steps, and its start and end in the shown
    step); and the shown step."""
    spans = instruction_spans(program, results, passes)
    shown = shown_step(results, warmup_steps)
    starts = [s.start_s for r in results for s in r.spans if s.category is SpanCategory.STEP and s.step == shown]
    t0 = min(starts)
    predicted = predicted_spans(program, sim) if sim is not None else {}
    out = []
    for r in results:
        steps = [m.step for m in measured_records(r, warmup_steps)]
        for i, ins in enumerate(program.instructions[r.device]):
            durations = [spans[(r.rank, k, i)].end_s - spans[(r.rank, k, i)].start_s for k in steps]
            seen = spans.get((r.rank, shown, i))
            p_start, p_end = predicted.get((r.device, i), (None, None))
            out.append(
                InstructionTiming(
                    id=instruction_id(r.device, ins.op),
                    device=r.device,
                    rank=r.rank,
                    index=i,
                    op=ins.op,
                    kind=InstructionKind(ins.kind),
                    phase=ins.phase if isinstance(ins, Compute) else None,
                    name=program.describe(ins),
                    predicted_start_s=p_start,
                    predicted_end_s=p_end,
                    measured_start_s=seen.start_s - t0 if seen is not None else None,
                    measured_end_s=seen.end_s - t0 if seen is not None else None,
                    measured_s=statistics.median(durations) if durations else None,
                )
            )
    return tuple(out), shown


def run_result(
    lowered: Lowered,
    devices: tuple[str, ...],
    cluster_name: str | None,
    results: Sequence[RankResult],
    options: RunOptions,
    *,
    shaping: LinkShapingRecord,
    notes: Sequence[str] = (),
) -> RunResult:
    """The RunResult of one run of `lowered`'s plan: the ranks' results summarised beside the
    simulation of the schedule that ran (when one was made)."""
    warmup = options.timing.warmup_steps
    sim = lowered.sim
    all_notes = list(notes)
    for r in results:
        all_notes += [w for w in r.warnings if w not in all_notes]
    passes = options.training.accumulate
    if passes > 1 and sim is not None:
        all_notes.append(
            f"--accumulate {passes}: a step runs {passes} batches' computes and transfers and one sync; "
            f"the predicted iteration is of one batch, and each instruction's measured time is the last batch's"
        )
    instructions, shown = instruction_timings(lowered.program, sim, results, warmup, passes)
    plan = lowered.plan
    return RunResult(
        strategy=plan.strategy,
        model=plan.model.name,
        cluster=cluster_name,
        devices=devices,
        options=options,
        repetitions=(repetition(results, warmup, sim),),
        predicted_iteration_time_s=lowered.predicted_iteration_time_s,
        prediction_source="simulator" if sim is not None else "not requested",
        step_lines=tuple(merge([s for r in results for s in r.steps], len(results))),
        instructions=instructions,
        shown_step=shown,
        spans=tuple(s for r in results for s in r.spans),
        link_shaping=shaping,
        notes=tuple(all_notes),
    )
