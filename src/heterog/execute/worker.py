"""The process of one rank: `python -m heterog.execute.worker SPEC.json`.

The launcher (local) or torchrun (real clusters) starts one per device. The spec (a
RankSpec, execute/spec.py) holds the Program, the rank → device map (or, under torchrun, the
devices of each node), the number of steps, the training, checkpoint and emulation settings.
The worker writes its RankResult to `result_rank<R>.json`, or a RankFailure to
`error_rank<R>.json` when it fails, into the spec's out_dir; the launcher reads them.

A multi-plan spec (a LaunchSpec: launcher.launch_local_many, for heterog.run_many and
run_interleaved) lists several plans:
the process runs them one after the other (`run_plans`), as the rank of every plan whose
`processes` list names it (by default rank r of every plan that has more than r devices),
each plan in a process group of its own (a fresh `init_process_group`
over a prefix of one shared store), and waits at a barrier of all processes after each plan,
so a plan that does not use it finds it idle. Plans of one model share its construction and
its export (`ModelCache`). A failure ends the process: the launcher starts the remaining
plans afresh.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from heterog.cut.dataflow import Dataflow, detach_unheld
from heterog.cut.partition import build_dataflow, program_group_order
from heterog.cut.split_export import ExportedModel
from heterog.errors import RankError
from heterog.execute import checkpoint, shard
from heterog.execute.device import RankDevice, check_gpu_type, rank_device
from heterog.execute.emulation import Pacer, memory_cap, pin_to_cores
from heterog.execute.faults import inject_fault, overflow_gradient
from heterog.execute.model_cache import ModelCache, rank_model
from heterog.execute.placement import place_rank, rewrite_stage_devices
from heterog.execute.runtime import Interpreter
from heterog.execute.spec import FailureKind, LaunchSpec, RankFailure, RankResult, RankSpec, read_spec
from heterog.execute.stage_map import crossing_values
from heterog.execute.steplog import STEPS_FILE, TRACE_FILE, StepLog
from heterog.execute.sync import ProgramSync
from heterog.execute.tp_rank import TensorParallelState, join_sets, sibling_ranks
from heterog.execute.trace import StepRecorder
from heterog.execute.train_loop import TrainingHooks, gradient_norm, needs_norm, recipe_of
from heterog.execute.transport import Channels, Transport, transfer_pairs
from heterog.execute.wire import wire_table
from heterog.ir.kinds import Precision
from heterog.ir.plan import Plan
from heterog.ir.run_request import FaultKind, FaultPhase
from heterog.ir.run_result import Span, SpanCategory, StepRecord
from heterog.jsonio import write_atomic
from heterog.lower.program import Program
from heterog.lower.tensor_parallel import member_view
from heterog.training import Recipe
from heterog.workload import Workload, global_batch, resolve_workload, to_device, with_data


def _init(spec: RankSpec, store: Any = None) -> tuple[int, int, str, RankDevice]:
    """Join the process group; return (rank, world size, this rank's plan device, its torch
    device): the GPU the plan names when the run is on GPUs (NCCL, or gloo with host copies
    when ranks share a GPU), else the CPU (gloo). `store`: rendezvous through it (a
    multi-plan launch) instead of the spec's address."""
    timeout = timedelta(seconds=spec.timeout_s)
    if "RANK" in os.environ and spec.torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        device = spec.node_devices[int(os.environ["GROUP_RANK"])][local]
        # the printed command sets CUDA_VISIBLE_DEVICES to the node's planned GPUs, in order
        rdev = rank_device(use_cuda=spec.cuda, index=local, rank=rank)
        _activate(rdev, spec, device, rank)
        dist.init_process_group(rdev.backend, rank=rank, world_size=world, timeout=timeout)
        return rank, world, device, rdev
    rank, world = spec.rank, len(spec.devices)
    device = spec.devices[rank]
    indices = spec.cuda_indices or tuple(range(world))
    rdev = rank_device(use_cuda=spec.cuda, index=indices[rank], rank=rank, host_staging=spec.host_staging)
    _activate(rdev, spec, device, rank)
    if store is not None:
        dist.init_process_group(rdev.backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(
            rdev.backend,
            init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    return rank, world, device, rdev


def _activate(rdev: RankDevice, spec: RankSpec, device: str, rank: int) -> None:
    """Select the rank's GPU and refuse one of another type than the plan's device."""
    rdev.activate()
    if rdev.kind == "cuda":
        expected = spec.gpu_types.get(device)
        if expected:
            check_gpu_type(rdev, expected, device=device, rank=rank)


@dataclass(kw_only=True)
class RankSetup:
    """Everything a rank builds before step 1 (`build_rank`): the split placed on its device,
    its transfers, syncs, optimizer and interpreter."""

    rank: int
    device: str
    plan: Plan
    work: Workload
    flow: Dataflow
    held: set[int]
    params: list[nn.Parameter]
    named: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer | None
    transport: Transport
    sync: ProgramSync
    interpreter: Interpreter
    pacer: Pacer
    cap: Any
    recipe: Recipe  # the run's optimizer, schedule and training options
    tp: TensorParallelState | None = None  # a member of a tensor-parallel set: its slices


def _split_for_rank(
    program: Program, plan: Plan, work: Workload, model: nn.Module, exported: ExportedModel | None, placed: _Placed
) -> tuple[Dataflow, set[int], dict[tuple[int, int], list[str]], Any]:
    """The model split at the Program's blocks, this rank's stages on its device (placement.py),
    the values that cross between blocks and their wire table (wire.py); (flow, the groups
    held here, the crossing values, the wire table)."""
    rdev = placed.rdev
    inputs0, _ = global_batch(work, plan.batch_size, seed=placed.seed, step=0)
    flow = build_dataflow(model, plan, len(inputs0), group_order=program_group_order(program), exported=exported)
    held = {gi for gi, g in enumerate(plan.groups) if placed.device in g.devices}
    rdev.set_math_mode(plan.precision)
    rewrite_stage_devices(flow.stages, rdev.torch_device)
    place_rank(flow, held, rdev.torch_device, rank=placed.rank)
    crossing = crossing_values(program, flow)
    wire = wire_table(
        flow,
        to_device(inputs0, rdev.torch_device),
        {v for vs in crossing.values() for v in vs},
        device=rdev.torch_device,
        autocast=rdev.autocast(plan.precision),
    )
    detach_unheld(flow, held)
    return flow, held, crossing, wire


@dataclass(frozen=True, kw_only=True, slots=True)
class _Placed:
    """Where a rank runs: its rank, plan device, torch device, the rank of every device."""

    rank: int
    device: str
    rdev: RankDevice
    rank_of: dict[str, int]
    seed: int


def build_rank(
    spec: RankSpec,
    rank: int,
    device: str,
    rdev: RankDevice,
    rank_of: dict[str, int],
    *,
    models: ModelCache | None = None,
    program: Program | None = None,
) -> RankSetup:
    """Split the model for the Program (the spec's, when not given loaded), place this rank's
    stages on its device and check them (placement.py), derive the wire table (wire.py), and
    make the transport, the syncs, the optimizer and the interpreter."""
    whole = program or spec.load_program()
    program, plan, place = member_view(whole, device)  # a tensor-parallel member: its sibling's part
    tp = join_sets(Plan.from_dict(whole.plan), place, rank_of, spec.timeout_s)
    work = with_data(resolve_workload(plan.model), spec.training.data)
    seed = spec.seed
    model, exported, tp_state = rank_model(models, work, plan, seed, tp, whole.tp_regions)
    placed = _Placed(rank=rank, device=device, rdev=rdev, rank_of=rank_of, seed=seed)
    flow, held, crossing, wire = _split_for_rank(program, plan, work, model, exported, placed)
    channels = Channels(transfer_pairs(whole, rank_of), spec.timeout_s)  # every sibling's, on every rank
    transport = Transport(
        rank=rank,
        device=rdev.torch_device,
        program=program,
        rank_of=rank_of,
        crossing=crossing,
        no_grad=flow.no_grad,
        wire=wire,
        channels=channels,
        timeout_s=spec.timeout_s,
        host_staging=rdev.host_staging,
    )
    recipe = recipe_of(spec.training, plan, spec.steps)  # [train] the user's optimizer, schedule, clipping
    sync = ProgramSync(
        program=program,
        flow=flow,
        rank=rank,
        optimizer=recipe,
        timeout_s=spec.timeout_s,
        device=rdev.torch_device,
        host_staging=rdev.host_staging,
        deferred=plan.precision == Precision.FP16 or needs_norm(recipe.config),
        clock=rdev.clock(),
        mirrors=sibling_ranks(place, rank_of),
    )
    named = [(n, p) for g in sorted(held) for n, p in flow.params_of_group.get(g, [])]
    opt, params, named = shard.rank_parameters(recipe, named, sync.shards)  # the optimizer steps the pieces too
    pacer = Pacer(spec.slowdown(device))
    cap = None if rdev.kind != "cpu" else memory_cap(plan.cluster, device)  # emulated devices only
    counted = tp_state.counted if tp_state is not None else None  # tensor parallelism: a member's slices
    ex = Interpreter(
        program=program,
        device=device,
        flow=flow,
        work=work,
        transport=transport,
        pacer=pacer,
        sync=sync,
        batch_size=plan.batch_size,
        rank_of=rank_of,
        optimizer=opt,
        rank_device=rdev,
        precision=plan.precision,
        memory_cap=cap,
        crossing=crossing,
        shards=sync.shards,
        scheduler=recipe.make_scheduler(opt),  # [train]
        grad_norm=gradient_norm(recipe.config, sync, named, rdev.torch_device, rdev.host_staging, only=counted),
        max_grad_norm=recipe.config.max_grad_norm,
    )
    if tp_state is not None:
        tp_state.attach(ex)
    return RankSetup(
        rank=rank, device=device, plan=plan, work=work, flow=flow, held=held, params=params, named=named,
        optimizer=opt, transport=transport, sync=sync, interpreter=ex, pacer=pacer, cap=cap, recipe=recipe,
        tp=tp_state,
    )  # fmt: skip


def _join(spec: RankSpec, program: Program, store: Any) -> tuple[int, str, RankDevice, dict[str, int]]:
    """Join the run's process group and learn every rank's device: (rank, device, torch
    device, the rank of each device)."""
    rank, world, device, rdev = _init(spec, store)
    devices_by_rank: list[str] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(devices_by_rank, device)
    rank_of = {d: r for r, d in enumerate(devices_by_rank)}
    missing = [d for d in program.devices if d not in rank_of]
    if missing:
        raise RankError(
            rank, f"the program uses device(s) {missing} that no rank was started for; ranks run {devices_by_rank}."
        )
    return rank, device, rdev, rank_of


def train(spec: RankSpec, out_dir: Path, *, store: Any = None, models: ModelCache | None = None) -> RankResult:
    """Train this rank's part of the plan for the spec's steps (from a checkpoint when it
    resumes one); what it measured."""
    torch.set_num_threads(spec.threads)
    program = spec.load_program()
    rank, device, rdev, rank_of = _join(spec, program, store)
    progress = out_dir / f"progress_rank{rank}"
    cores = pin_to_cores(rank) if spec.pin_cores else None
    setup = build_rank(spec, rank, device, rdev, rank_of, models=models, program=program)
    first_step = checkpoint.resume(
        spec.checkpoint, setup.named, setup.optimizer, model=setup.plan.model.name, servers=setup.sync.ps_buckets(),
        shards=setup.sync.shards, tp=setup.tp,
    )  # fmt: skip
    rec = StepRecorder(rank=rank, device=device)  # measured spans → trace_rank<R>.json
    step_log = StepLog(out_dir / STEPS_FILE.format(rank=rank))  # one line per step, as it ends
    hooks = TrainingHooks.start(setup.recipe, rank=rank, seed=spec.seed, model_name=setup.plan.model.name)
    hooks.resumed(setup.interpreter, first_step)  # [train] schedules at the checkpoint's step
    try:
        steps = [
            _train_step(spec, setup, rdev, rec, step_log, step, progress, hooks)
            for step in range(first_step, spec.steps)
        ]
    finally:
        hooks.close()
    progress.write_text("done")
    write_atomic(out_dir / TRACE_FILE.format(rank=rank), json.dumps(rec.to_dict()))
    if spec.dump_params:  # with the parameters: what ran, for tests against the Program
        _dump(setup, out_dir)
    dist.barrier()
    setup.sync.runner.close()  # its sync thread (a multi-plan launch would keep one per plan)
    dist.destroy_process_group()
    return _rank_result(setup, rdev, cores, tuple(steps), tuple(rec.spans), hooks.evaluations)


def _dump(setup: RankSetup, out_dir: Path) -> None:
    """What this rank executed, the samples it computed, its parameters after the last step."""
    ex, rank = setup.interpreter, setup.rank
    write_atomic(out_dir / f"executed_rank{rank}.json", json.dumps(ex.trace))
    write_atomic(out_dir / f"samples_rank{rank}.json", json.dumps(ex.samples))
    params = shard.whole_parameters(setup.named, setup.sync.shards)
    if setup.tp is not None:  # a tensor-parallel member's slices, whole (collective over its set)
        params = {name: setup.tp.whole(name, value) for name, value in params.items()}
    torch.save(params, out_dir / f"params_rank{rank}.pt")


def _rank_result(
    setup: RankSetup,
    rdev: RankDevice,
    cores: list[int] | None,
    steps: tuple[StepRecord, ...],
    spans: tuple[Span, ...],
    evaluations: list[dict[str, Any]],
) -> RankResult:
    memory = rdev.memory()
    cap = setup.cap
    return RankResult(
        rank=setup.rank,
        device=setup.device,
        slowdown=setup.pacer.slowdown,
        cores=tuple(cores) if cores is not None else None,
        groups=tuple(setup.plan.groups[g].name for g in sorted(setup.held)),
        steps=steps,
        spans=spans,
        sent_bytes=int(setup.transport.sent_bytes),
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        torch_device=str(rdev.torch_device),
        backend=rdev.backend,
        host_staging=rdev.host_staging,
        peak_allocated_bytes=memory.get("peak_allocated_bytes"),
        peak_reserved_bytes=memory.get("peak_reserved_bytes"),
        memory_cap_bytes=cap.cap_bytes if cap else None,
        peak_live_bytes=int(setup.interpreter.peak_live_bytes) if cap else None,
        split=setup.flow.split,
        warnings=tuple(setup.flow.warnings),
        training=setup.recipe.describe(shard.as_held(setup.named, setup.sync.shards)) if setup.rank == 0 else None,
        evaluations=tuple(evaluations),
    )


def _train_step(
    spec: RankSpec,
    setup: RankSetup,
    rdev: RankDevice,
    rec: StepRecorder,
    step_log: StepLog,
    step: int,
    progress: Path,
    hooks: TrainingHooks,
) -> StepRecord:
    """One training step of this rank, timed with the rank's clock (CUDA events on a GPU,
    read once the step has finished); its record."""
    rank, ex = setup.rank, setup.interpreter
    progress.write_text(str(step))
    inject_fault(spec.fault, rank, step, spec.timeout_s)
    batches = hooks.batches(setup.work, setup.plan.batch_size, step)  # [train] --accumulate
    dist.barrier()
    for p in setup.params:
        p.grad = None
    ex.tp_marks.clear()  # an evaluation's all-reduces are not the step's
    origin, origin_s = ex.clock.mark(), rec.now_s()
    if spec.fault is not None and spec.fault.kind is FaultKind.OVERFLOW:
        ex.overflow_hook = lambda: overflow_gradient(spec.fault, rank, step, setup.params)
    loss = hooks.train(ex, batches)
    inject_fault(spec.fault, rank, step, spec.timeout_s, FaultPhase.MID)
    end = ex.clock.mark()
    rdev.synchronize()
    step_time_s = ex.clock.seconds(origin, end)
    spans = ex.read_timings(rank=rank, step=step, origin=origin, origin_s=origin_s)
    outer = Span(
        name=f"step {step}",
        category=SpanCategory.STEP,
        rank=rank,
        step=step,
        start_s=origin_s,
        end_s=origin_s + step_time_s,
    )
    rec.add([outer, *spans])
    st = ex.stats
    figures = hooks.after(  # [train] learning rate, gradient norm, metrics line, evaluation when due
        ex, step=step, step_time_s=step_time_s, batches=batches, batch_size=setup.plan.batch_size, work=setup.work
    )
    record = StepRecord(
        step=step,
        rank=rank,
        device=setup.device,
        loss=float(loss),
        step_time_s=step_time_s,
        compute_s=st.compute_s,
        cpu_s=st.cpu_s,
        paced_s=st.paced_s,
        recv_wait_s=st.recv_wait_s,
        sync_s=st.sync_s,
        loss_scale=ex.scaler.scale if ex.scaler is not None else None,
        skipped_steps=ex.skipped_steps,
        lr=figures.lr,
        grad_norm=figures.grad_norm,
    )
    step_log.append(record)
    checkpoint.save_if_due(
        spec.checkpoint, step + 1, setup.named, setup.optimizer, rank=rank, model=setup.plan.model.name,
        servers=setup.sync.ps_buckets(), shards=setup.sync.shards, tp=setup.tp,
    )  # fmt: skip
    return record


def _report(out_dir: Path, rank: int, work: Callable[[], RankResult]) -> int:
    """Run `work`; write its result, or the failure for the launcher; the exit code."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = work()
    except BaseException as e:  # report any failure to the launcher, then exit non-zero
        text = str(e).lower()
        kind = (
            FailureKind.TIMEOUT
            if isinstance(e, RankError) or "timed out" in text or "timeout" in text
            else FailureKind.PEER
            if ("connection" in text or "peer" in text or "broken pipe" in text)
            else FailureKind.ERROR
        )
        RankFailure(rank=rank, kind=kind, type=type(e).__name__, message=str(e), traceback=traceback.format_exc()).save(
            out_dir
        )
        return 1
    result.save(RankResult.path(out_dir, rank))
    return 0


def _store_barrier(store: Any, key: str, world: int, timeout_s: float) -> None:
    """Every process of the launch reaches `key` before any goes on."""
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timedelta(seconds=timeout_s))


def run_plans(spec: LaunchSpec) -> int:
    """A multi-plan spec (module docstring): each plan in turn, as its rank when the plan's
    `processes` name this process (`spec.rank`); idle at the barrier after each plan otherwise."""
    me, world = spec.rank, spec.world
    store = dist.TCPStore(
        spec.master_addr, spec.master_port, world, is_master=me == 0, timeout=timedelta(seconds=spec.timeout_s)
    )
    models = ModelCache()
    for entry in spec.plans:
        out_dir = Path(entry.out_dir)
        if me in entry.processes:  # rank of the plan: the place of this process in its list
            plan_spec = spec.rank_spec(entry)
            prefixed = dist.PrefixStore(f"plan{entry.index}/", store)
            if _report(
                out_dir, plan_spec.rank, functools.partial(train, plan_spec, out_dir, store=prefixed, models=models)
            ):
                return 1
        _store_barrier(store, f"after{entry.index}", world, entry.wait_s)
    if me == 0:  # the store lives in this process: leave last
        store.wait([f"left{r}" for r in range(1, world)], timedelta(seconds=spec.timeout_s))
    else:
        store.set(f"left{me}", "1")
    return 0


def main(argv: list[str]) -> int:
    spec = read_spec(argv[0])
    if isinstance(spec, LaunchSpec):
        return run_plans(spec)
    rank = int(os.environ.get("RANK", spec.rank))
    out_dir = Path(spec.out_dir)
    return _report(out_dir, rank, lambda: train(spec, out_dir))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
