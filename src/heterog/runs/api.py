"""One API for training plans on local processes: `run_plans(plans, options, order=…)`, and
its three orderings under the names users call (each returns RunResults, ir/run_result.py):

  run(plan, …)               ALONE: the plan's own launch (per repetition), any cluster this
                             machine can run — emulated CPU processes, or GPUs
  run_many(plans, …)         ONE_LAUNCH: the plans one after the other in one launch of the
                             rank processes (the model built and exported once per model
                             spec), for sweeps such as every planner candidate; links not shaped
  run_interleaved(plans, …)  INTERLEAVED: plans of one emulated cluster side by side — one
                             process per device for the whole launch (so each node keeps its
                             namespace and shaped link), rounds of every plan in turn (A B C,
                             then C B A), a plan's rank run in the process of its device

A plan is lowered once (orchestrate.lowered: its Program and the simulation of that very
schedule); every repetition carries out that Program, and the prediction goes beside each.
A plan that fails in run_many or run_interleaved is a RunResult with `failure` set, and the
others go on; `run` raises the failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from heterog.errors import HeterogError, PlanError
from heterog.execute.launcher import LaunchConfig, PlanLaunch, ProcessLayout, launch_local, launch_local_many
from heterog.execute.preflight import check_inputs, check_training
from heterog.execute.spec import RankSpec
from heterog.hardware.cluster import Cluster
from heterog.inputs import PlanInputs, as_plan
from heterog.ir.plan import Plan
from heterog.ir.run_request import DeviceLayout, Fault, RunOptions, RunRequest
from heterog.ir.run_result import LinkShapingRecord, RunFailure, RunResult, combine_repetitions
from heterog.ir.training_config import TrainingConfig
from heterog.orchestrate import Lowered, lowered
from heterog.runs.layout import emulated_slowdowns, local_ranks, rank_layout, shape_links
from heterog.runs.provenance import pinned_resume
from heterog.runs.summary import run_result


class RunOrder(StrEnum):
    ALONE = "alone"  # one launch per plan and repetition
    ONE_LAUNCH = "one-launch"  # the plans one after the other in one launch
    INTERLEAVED = "interleaved"  # rounds of every plan, alternating order, one process per device


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM → KeyboardInterrupt, so cleanup in finally blocks runs (main thread only)."""
    try:
        old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _failed(plan: Plan, options: RunOptions, error: Exception) -> RunResult:
    return RunResult(
        strategy=plan.strategy,
        model=plan.model.name,
        cluster=None,
        devices=(),
        options=options,
        failure=RunFailure(type=type(error).__name__, message=str(error), rank=getattr(error, "rank", None)),
        exception=error,
    )


def run_plans(
    plans: Sequence[Any],
    options: RunOptions | None = None,
    *,
    order: RunOrder = RunOrder.ALONE,
    inputs: PlanInputs | tuple | None = None,
    faults: dict[int, Fault] | None = None,
) -> list[RunResult]:
    """Train every plan (anything inputs.as_plan takes) `options.steps` steps, in `order`;
    one RunResult per plan, in the order given (its repetitions inside). inputs: the (graph,
    cluster, costs) the caller predicts with (a profiled, link-calibrated cost model), so the
    Programs that run are the schedules it predicts. faults: a test hook, plan index → its
    Fault (options.fault for every plan otherwise)."""
    opts = options or RunOptions()
    loaded = [as_plan(p) for p in plans]
    hooks = {i: (faults or {}).get(i, opts.fault) for i in range(len(loaded))}
    if order is RunOrder.ALONE:
        out = []
        for i, plan in enumerate(loaded):
            try:
                out.append(_alone(plan, dataclasses.replace(opts, fault=hooks[i]), inputs))
            except (HeterogError, OSError) as e:  # `run` raises it; a sweep goes on
                out.append(_failed(plan, opts, e))
        return out
    if opts.checkpoint.active or opts.layout != DeviceLayout():
        raise PlanError(
            f"{order} runs are for emulated clusters' plans on CPU processes, without checkpoints or "
            f"device layout options; run such a plan alone (heterog.run)."
        )
    return _in_one_launch(loaded, opts, inputs, hooks, interleave=order is RunOrder.INTERLEAVED)


def run(plan: Any, options: RunOptions | None = None, /, *, inputs: Any = None, **fields: Any) -> RunResult:
    """Train `plan` (anything inputs.as_plan takes, or a RunRequest) on local processes —
    one rank per device: emulated CPU processes, or this machine's GPUs for a real cluster's
    plan (one NCCL algorithm and protocol on every rank when the GPU types differ) — and put
    the simulator's prediction of the same schedule beside the measurement. `fields` replace
    fields of `options` (RunOptions.with_): heterog.run(plan, steps=3),
    heterog.run(plan, layout=DeviceLayout(emulated=True)). Raises what stopped the run."""
    if isinstance(plan, RunRequest):
        options, plan = options or plan.options, plan.plan
    opts = (options or RunOptions()).with_(**fields)
    (result,) = run_plans([plan], opts, inputs=inputs)
    result.raise_for_failure()
    return result


def run_many(plans: Sequence[Any], options: RunOptions | None = None, /, **fields: Any) -> list[RunResult]:
    """run_plans in one launch (ONE_LAUNCH): the processes start, import torch and export each
    model once for all the plans, instead of once per plan as `run` does. Plans of emulated
    clusters only, their links not shaped. out_dir keeps plan i's files (its Program, its
    ranks' results) in `plan<i>/`; with dump_params each rank also writes its parameters
    after the last step and the instructions it executed there. `faults` and `inputs` as
    run_plans'; other fields replace fields of `options`."""
    hooks = {k: fields.pop(k) for k in ("faults", "inputs") if k in fields}
    return run_plans(plans, (options or RunOptions()).with_(**fields), order=RunOrder.ONE_LAUNCH, **hooks)


def run_interleaved(plans: Sequence[Any], options: RunOptions | None = None, /, **fields: Any) -> list[RunResult]:
    """run_plans interleaved (INTERLEAVED): options.timing.repetitions rounds, each training
    every plan in turn (A B C, then C B A, …), all in one launch of one process per device of
    one emulated cluster. On a shared machine whose speed drifts, consecutive plans then run
    seconds apart instead of a launch (~10 s of imports and export) apart, so the per-round
    ratio of two plans compares like with like; the start-up and the namespaces (links shaped
    as `run` shapes them) are paid once. A plan that fails is not run again; the others go
    on. out_dir keeps round r of plan i in `rep<r>/plan<i>/`."""
    hooks = {k: fields.pop(k) for k in ("faults", "inputs") if k in fields}
    return run_plans(plans, (options or RunOptions()).with_(**fields), order=RunOrder.INTERLEAVED, **hooks)


def checked_training(plan: Plan, config: TrainingConfig, steps: int) -> TrainingConfig:
    """The run's training options as the ranks get them (a decaying schedule's horizon: the
    run's `steps`), after the checks that need no rank (execute/preflight.py); options left at
    their defaults (but --data) are the plan's optimizer as it is, and need none."""
    if dataclasses.replace(config, data=None) == TrainingConfig():
        return config
    return check_training(plan, config, steps=steps)


def _alone(plan: Plan, options: RunOptions, inputs: Any, stop: Callable[[], bool] | None = None) -> RunResult:
    """Each repetition of `plan` in its own launch; one result with every repetition, and the
    checkpoint it resumed from (runs/provenance.py). stop: polled while the ranks run; True
    ends them (launcher.RunStopped; an elastic run's supervisor)."""
    cluster, devices = local_ranks(plan)
    options, resumed = pinned_resume(plan, cluster, devices, options)
    training = checked_training(plan, options.training, options.steps)
    check_inputs(plan, training.data)  # the first batch within the model's sequence limit and vocabulary
    pred = options.prediction
    lw = lowered(plan, cluster, predict=pred.predict, profile=pred.profile, inputs=inputs)
    out_dir = Path(options.output.out_dir) if options.output.out_dir else None
    if out_dir is not None:
        lw.program.save(out_dir / "program.json")
    layout = rank_layout(plan, cluster, devices, options.layout)
    reps = []
    for _ in range(options.timing.repetitions):
        with contextlib.ExitStack() as stack:
            stack.enter_context(_sigterm_as_interrupt())
            links = shape_links(stack, cluster, devices, options.links)
            spec = RankSpec(
                program=lw.program.to_dict(),
                devices=devices,
                steps=options.steps,
                seed=options.seed,
                timeout_s=options.limits.timeout_s,
                training=training,
                checkpoint=options.checkpoint,
                slowdowns=layout.slowdowns,
                pin_cores=options.layout.pin_cores,
                dump_params=options.output.dump_params,
                fault=options.fault,
                cuda=layout.cuda,
                cuda_indices=layout.cuda_indices,
                host_staging=layout.host_staging,
                gpu_types=layout.gpu_types,
                master_addr=links.master_addr,
            )
            env = {r: {**links.env.get(r, {}), **layout.env.get(r, {})} for r in range(len(devices))}
            cfg = LaunchConfig(spec=spec, wrap=links.wrap, env=env, force=options.limits.force, stop=stop)
            results = launch_local(plan, cfg, out_dir)
        notes = [*layout.notes, *([links.note] if links.note else [])]
        reps.append(run_result(lw, devices, cluster.name, results, options, shaping=links.record, notes=notes))
    return dataclasses.replace(combine_repetitions(reps), resumed_from=resumed)


@dataclass(frozen=True, kw_only=True)
class _Prepared:
    lowered: Lowered
    cluster: Cluster
    devices: tuple[str, ...]
    launch: PlanLaunch


def _prepare(
    plan: Plan, index: int, graphs: dict[str, Any], options: RunOptions, inputs: Any, fault: Fault | None
) -> _Prepared:
    """Lower plan `index` of a multi-plan launch (the model captured once per model spec:
    `graphs`); its Program saved in its folder, as `run` saves it."""
    cluster, devices = local_ranks(plan)
    if cluster.kind != "emulated":
        raise PlanError(
            f"run_many and run_interleaved run emulated clusters' plans on CPU processes; the plan's "
            f"cluster {cluster.name!r} is a real one: run it with heterog.run."
        )
    key = json.dumps(plan.to_dict()["model"], sort_keys=True, default=str)
    pred = options.prediction
    lw = lowered(plan, cluster, predict=pred.predict, profile=pred.profile, graph=graphs.get(key), inputs=inputs)
    graphs[key] = lw.inputs.graph
    folder = f"plan{index}"
    if options.output.out_dir:
        lw.program.save(Path(options.output.out_dir) / folder / "program.json")
    launch = PlanLaunch(
        plan=plan,
        program_doc=lw.program.to_dict(),
        devices=devices,
        slowdowns=emulated_slowdowns(plan, cluster, devices, False),
        fault=fault,
        dump_params=options.output.dump_params,
        folder=folder,
        key=folder,
        training=checked_training(plan, options.training, options.steps),
    )
    return _Prepared(lowered=lw, cluster=cluster, devices=devices, launch=launch)


def _rounds(n_plans: int, repetitions: int, interleave: bool) -> list[tuple[int, int]]:
    """(round, plan) in launch order; interleaved, odd rounds run the plans in reverse (A B C
    C B A A B C …), so a drift of the machine's speed within a round does not always fall on
    the same plans."""
    return [
        (r, i)
        for r in range(repetitions)
        for i in (reversed(range(n_plans)) if interleave and r % 2 else range(n_plans))
    ]


def _in_one_launch(
    loaded: list[Plan], options: RunOptions, inputs: Any, faults: dict[int, Fault | None], *, interleave: bool
) -> list[RunResult]:
    """Every round of every plan in one launch of rank processes (launcher.launch_local_many);
    interleaved: one process per device of the plans' one cluster, links shaped."""
    if interleave and len({p.cluster_fingerprint for p in loaded}) > 1:
        raise PlanError(
            "run_interleaved measures plans of one cluster side by side; the plans were made "
            "for different clusters (their cluster fingerprints differ): run each group apart."
        )
    graphs: dict[str, Any] = {}
    prepared: list[_Prepared | Exception] = []
    for i, plan in enumerate(loaded):
        try:
            prepared.append(_prepare(plan, i, graphs, options, inputs, faults[i]))
        except (HeterogError, OSError) as e:  # reported in that plan's result; the others run
            if interleave:
                raise
            prepared.append(e)
    ready = [i for i, p in enumerate(prepared) if isinstance(p, _Prepared)]
    reps = options.timing.repetitions
    order = [(r, i) for r, i in _rounds(len(loaded), reps, interleave) if i in ready]
    entries = [_entry(prepared[i], r, i, interleave or reps > 1) for r, i in order]  # type: ignore[arg-type]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_interrupt())
        layout, shaping, note = _process_layout(stack, [prepared[i] for i in ready], options, interleave)  # type: ignore[misc]
        launched = (
            launch_local_many(
                entries,
                steps=options.steps,
                timeout_s=options.limits.timeout_s,
                seed=options.seed,
                out_dir=Path(options.output.out_dir) if options.output.out_dir else None,
                force=options.limits.force,
                layout=layout,
            )
            if entries
            else []
        )
    out = []
    for i, (plan, prep) in enumerate(zip(loaded, prepared)):
        got = [launched[k] for k, (_, j) in enumerate(order) if j == i]  # plan i's rounds, in order
        error = prep if isinstance(prep, Exception) else next((g for g in got if isinstance(g, Exception)), None)
        if error is not None:
            out.append(_failed(plan, options, error))
            continue
        assert isinstance(prep, _Prepared)
        notes = [note] if note else []
        results = [
            run_result(prep.lowered, prep.devices, prep.cluster.name, g, options, shaping=shaping, notes=notes)
            for g in got
            if not isinstance(g, Exception)
        ]
        out.append(combine_repetitions(results))
    return out


def _entry(prep: _Prepared, r: int, i: int, per_round: bool) -> PlanLaunch:
    """Round r of plan i: its folder `rep<r>/plan<i>` (`plan<i>` when there is one round and
    the plans are not interleaved)."""
    return dataclasses.replace(prep.launch, folder=f"rep{r}/plan{i}" if per_round else f"plan{i}")


def _process_layout(
    stack: contextlib.ExitStack, prepared: list[_Prepared], options: RunOptions, interleave: bool
) -> tuple[ProcessLayout | None, LinkShapingRecord, str | None]:
    """One launch's processes: one per device with shaped links when interleaved (a plan's
    rank runs in its device's process), else process r is rank r of every plan."""
    if not interleave or not prepared:
        return None, LinkShapingRecord(enabled=False, reason="run_many does not shape links"), None
    cluster = prepared[0].cluster
    used = {d for p in prepared for d in p.devices}
    devices = tuple(d.name for d in cluster.devices if d.name in used)
    links = shape_links(stack, cluster, devices, options.links)
    layout = ProcessLayout(devices=devices, wrap=links.wrap, env=links.env, master_addr=links.master_addr)
    return layout, links.record, links.note
