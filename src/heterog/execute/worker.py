"""The process of one rank: `python -m heterog.execute.worker SPEC.json`.

The launcher (local) or torchrun (real clusters) starts one per device. The spec (JSON)
holds the plan, the rank → device map (or, under torchrun, the devices of each node), the
number of steps and the emulation settings. The worker writes `result_rank<R>.json`, or
`error_rank<R>.json` when it fails, into the spec's out_dir; the launcher reads them.

A multi-plan spec (launcher.launch_local_many, for pipeline.run_many) lists several plans:
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
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from heterog.cut.dataflow import Dataflow, detach_unheld
from heterog.cut.partition import build_dataflow, export_plan_model, program_group_order
from heterog.cut.split_export import ExportedModel, copy_exported
from heterog.errors import PlanError, RankError
from heterog.execute import checkpoint
from heterog.execute.device import RankDevice, check_gpu_type, rank_device
from heterog.execute.emulation import Pacer, memory_cap, pin_to_cores
from heterog.execute.placement import place_rank, rewrite_stage_devices
from heterog.execute.runtime import Interpreter, crossing_values
from heterog.execute.shard import make_optimizer
from heterog.execute.steplog import STEPS_FILE, TRACE_FILE, StepLog, StepRecord
from heterog.execute.sync import ProgramSync
from heterog.execute.trace import Span, SpanCategory, StepRecorder
from heterog.execute.train_loop import TrainingHooks, gradient_norm, needs_norm, recipe_of
from heterog.execute.transport import Channels, Transport, transfer_pairs
from heterog.execute.wire import wire_table
from heterog.ir.kinds import Precision
from heterog.ir.plan import Plan
from heterog.jsonio import write_atomic
from heterog.lower.program import Program
from heterog.workload import (
    Workload,
    build_model,
    global_batch,
    resolve_workload,
    to_device,
    with_data,
)


def _init(spec: dict[str, Any], store: Any = None) -> tuple[int, int, str, RankDevice]:
    """Join the process group; return (rank, world size, this rank's plan device, its torch
    device): the GPU the plan names when the run is on GPUs (NCCL, or gloo with host copies
    when ranks share a GPU), else the CPU (gloo). `store`: rendezvous through it (a
    multi-plan launch) instead of the spec's address."""
    timeout = timedelta(seconds=spec["timeout_s"])
    if "RANK" in os.environ and spec.get("torchrun"):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        device = spec["node_devices"][int(os.environ["GROUP_RANK"])][local]
        # the printed command sets CUDA_VISIBLE_DEVICES to the node's planned GPUs, in order
        rdev = rank_device(use_cuda=spec.get("cuda", False), index=local, rank=rank)
        _activate(rdev, spec, device, rank)
        dist.init_process_group(rdev.backend, rank=rank, world_size=world, timeout=timeout)
        return rank, world, device, rdev
    rank = spec["rank"]
    world = len(spec["devices"])
    device = spec["devices"][rank]
    indices = spec.get("cuda_indices") or list(range(world))
    rdev = rank_device(
        use_cuda=spec.get("cuda", False), index=indices[rank], rank=rank, host_staging=bool(spec.get("host_staging"))
    )
    _activate(rdev, spec, device, rank)
    if store is not None:
        dist.init_process_group(rdev.backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(
            rdev.backend,
            init_method=f"tcp://{spec['master_addr']}:{spec['master_port']}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    return rank, world, device, rdev


def _activate(rdev: RankDevice, spec: dict[str, Any], device: str, rank: int) -> None:
    """Select the rank's GPU and refuse one of another type than the plan's device."""
    rdev.activate()
    if rdev.kind == "cuda":
        expected = (spec.get("gpu_types") or {}).get(device)
        if expected:
            check_gpu_type(rdev, expected, device=device, rank=rank)


def _fault(spec: dict[str, Any], rank: int, step: int, phase: str = "start") -> None:
    """Fault injection for the robustness tests: die or hang at a given step, at its start
    or (phase 'mid') between backward and the gradient sync, while the peers wait for it."""
    f = spec.get("fault")
    if f and f["rank"] == rank and f["step"] == step and f.get("phase", "start") == phase:
        if f["kind"] == "die":
            os._exit(17)
        if f["kind"] == "hang":
            time.sleep(10 * spec["timeout_s"] + 3600)


def _overflow(spec: dict[str, Any], rank: int, step: int, params: list[nn.Parameter]) -> None:
    """Test hook (fault kind 'overflow', fp16): an inf in this rank's first gradient at
    `step`, after the sync, as if its gradients had overflowed."""
    f = spec.get("fault")
    if f and f["kind"] == "overflow" and f["rank"] == rank and f["step"] == step:
        g = next((p.grad for p in params if p.grad is not None), None)
        if g is not None:
            g.view(-1)[0] = float("inf")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Built:
    model: nn.Module
    initial: dict[str, torch.Tensor]  # parameters and buffers as built
    rng_state: torch.Tensor  # the CPU generator right after the build
    exported: ExportedModel | None  # None: torch.export refused the model


@dataclass(kw_only=True)
class ModelCache:
    """The model and its export per model spec (and seed), for the plans of one multi-plan
    launch: exporting takes seconds, more than a 2-step run. Before each plan the parameters,
    the buffers and the random generator are put back as a fresh build leaves them, and the
    plan cuts its own copy of the export (the split rewrites the graph it is given)."""

    built: dict[str, _Built] = field(default_factory=dict)

    def get(self, work: Workload, plan: Plan, seed: int) -> tuple[nn.Module, ExportedModel | None]:
        key = json.dumps([plan.to_dict()["model"], plan.batch_size, seed], sort_keys=True, default=str)
        entry = self.built.get(key)
        if entry is None:
            model = build_model(work, seed=seed)
            rng_state = torch.get_rng_state()
            try:
                exported = export_plan_model(model, plan)
            except PlanError:
                exported = None  # build_dataflow says why, or runs the model whole
            initial = {k: t.detach().clone() for k, t in [*model.named_parameters(), *model.named_buffers()]}
            entry = self.built[key] = _Built(model=model, initial=initial, rng_state=rng_state, exported=exported)
        for name, t in [*entry.model.named_parameters(), *entry.model.named_buffers()]:
            t.data = entry.initial[name].clone()
            t.grad = None
        torch.set_rng_state(entry.rng_state)
        return entry.model, (copy_exported(entry.exported) if entry.exported is not None else None)


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
    recipe: Any = None  # training.Recipe: the run's optimizer, schedule and options


def _as_held(setup: RankSetup) -> list[nn.Parameter]:
    """The rank's parameters as the model holds them, for the record's optimizer groups: its
    sharded blocks' whole, by stand-ins of their shapes (as shard.make_optimizer made its optimizer)."""
    shards = setup.sync.shards
    held = [p for n, p in setup.named if n not in shards.sharded_names()]
    return held + [st for st, _ in shards.stand_ins(whole=True)]


def build_rank(
    spec: dict[str, Any],
    rank: int,
    device: str,
    rdev: RankDevice,
    rank_of: dict[str, int],
    *,
    models: ModelCache | None = None,
) -> RankSetup:
    """Split the model for the Program, place this rank's stages on its device and check
    them (placement.py), derive the wire table (wire.py), and make the transport, the syncs,
    the optimizer and the interpreter."""
    program = Program.from_dict(spec["program"], "the program of this run")
    plan = Plan.from_dict(program.plan)
    work = with_data(resolve_workload(plan.model), spec.get("data"))
    seed = spec.get("seed", 0)
    model, exported = models.get(work, plan, seed) if models is not None else (build_model(work, seed=seed), None)
    inputs0, _ = global_batch(work, plan.batch_size, seed=seed, step=0)
    flow = build_dataflow(model, plan, len(inputs0), group_order=program_group_order(program), exported=exported)
    held = {gi for gi, g in enumerate(plan.groups) if device in g.devices}
    rdev.set_math_mode(plan.precision)
    rewrite_stage_devices(flow.stages, rdev.torch_device)
    place_rank(flow, held, rdev.torch_device, rank=rank)
    crossing = crossing_values(program, flow)
    wire = wire_table(
        flow,
        to_device(inputs0, rdev.torch_device),
        {v for vs in crossing.values() for v in vs},
        device=rdev.torch_device,
        autocast=rdev.autocast(plan.precision),
    )
    detach_unheld(flow, held)
    timeout_s = spec["timeout_s"]
    channels = Channels(transfer_pairs(program, rank_of), timeout_s)
    transport = Transport(
        rank=rank,
        device=rdev.torch_device,
        program=program,
        rank_of=rank_of,
        crossing=crossing,
        no_grad=flow.no_grad,
        wire=wire,
        channels=channels,
        timeout_s=timeout_s,
        host_staging=rdev.host_staging,
    )
    recipe = recipe_of(spec, plan)  # [train] the user's optimizer, schedule, clipping (train_loop.py)
    sync = ProgramSync(
        program=program,
        flow=flow,
        rank=rank,
        optimizer=recipe,
        timeout_s=timeout_s,
        device=rdev.torch_device,
        host_staging=rdev.host_staging,
        deferred=plan.precision == Precision.FP16 or needs_norm(recipe.config),
        clock=rdev.clock(),
    )
    named = [(n, p) for g in sorted(held) for n, p in flow.params_of_group.get(g, [])]
    sharded, hidden = sync.shards.sharded_names(), sync.shards.hidden_names()
    whole = [p for n, p in named if n not in sharded]
    opt = make_optimizer(recipe, whole, sync.shards)  # the run's optimizer steps the pieces too
    params = whole + sync.shards.pieces() + sync.shards.model_params()  # their gradients are cleared every step
    named = [(n, p) for n, p in named if n not in hidden]  # held whole (checkpoints, dumps)
    pacer = Pacer(spec.get("slowdowns", {}).get(device, 1.0))
    cap = None if rdev.kind != "cpu" else memory_cap(plan.cluster, device)  # emulated devices only
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
        grad_norm=gradient_norm(recipe.config, sync, named, rdev.torch_device, rdev.host_staging),
        max_grad_norm=recipe.config.max_grad_norm,
    )
    return RankSetup(
        rank=rank,
        device=device,
        plan=plan,
        work=work,
        flow=flow,
        held=held,
        params=params,
        named=named,
        optimizer=opt,
        transport=transport,
        sync=sync,
        interpreter=ex,
        pacer=pacer,
        cap=cap,
        recipe=recipe,
    )


def train(
    spec: dict[str, Any], out_dir: Path, *, store: Any = None, models: ModelCache | None = None
) -> dict[str, Any]:
    torch.set_num_threads(spec.get("threads", 1))
    rank, world, device, rdev = _init(spec, store)
    progress = out_dir / f"progress_rank{rank}"
    cores = pin_to_cores(rank, spec.get("cores")) if spec.get("pin_cores") else None
    devices_by_rank: list[str] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(devices_by_rank, device)
    rank_of = {d: r for r, d in enumerate(devices_by_rank)}
    missing = [d for d in spec["program"]["devices"] if d not in rank_of]
    if missing:
        raise RankError(
            rank, f"the program uses device(s) {missing} that no rank was started for; ranks run {devices_by_rank}."
        )
    setup = build_rank(spec, rank, device, rdev, rank_of, models=models)
    ckpt = checkpoint.CheckpointConfig.from_dict(spec.get("checkpoint"))
    first_step = checkpoint.resume(
        ckpt,
        setup.named,
        setup.optimizer,
        model=setup.plan.model.name,
        servers=setup.sync.served(),
        shards=setup.sync.shards,
    )
    rec = StepRecorder(rank=rank, device=device)  # measured spans → trace_rank<R>.json
    step_log = StepLog(out_dir / STEPS_FILE.format(rank=rank))  # one line per step, as it ends
    hooks = TrainingHooks.start(setup.recipe, rank=rank, seed=spec.get("seed", 0), model_name=setup.plan.model.name)
    hooks.resumed(setup.interpreter, first_step)  # [train] schedules at the checkpoint's step
    try:
        steps = [
            _train_step(spec, setup, rdev, rec, step_log, step, progress, hooks)
            for step in range(first_step, spec["steps"])
        ]
    finally:
        hooks.close()
    progress.write_text("done")
    write_atomic(out_dir / TRACE_FILE.format(rank=rank), json.dumps(rec.to_dict()))
    ex, flow = setup.interpreter, setup.flow
    if spec.get("dump_params"):  # with the parameters: what ran, for tests against the Program
        write_atomic(out_dir / f"executed_rank{rank}.json", json.dumps(ex.trace))
        write_atomic(out_dir / f"samples_rank{rank}.json", json.dumps(ex.samples))
        params = {name: p.detach() for name, p in setup.named} | {
            k.removeprefix("model/"): v for k, v in setup.sync.shards.full_state(None, with_params=False).items()
        }
        torch.save({name: p.to("cpu").clone() for name, p in params.items()}, out_dir / f"params_rank{rank}.pt")
    dist.barrier()
    setup.sync.runner.close()  # its sync thread (a multi-plan launch would keep one per plan)
    dist.destroy_process_group()
    max_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    cap = setup.cap
    return {
        "rank": rank,
        "device": device,
        "slowdown": setup.pacer.slowdown,
        "cores": cores,
        "max_rss_bytes": max_rss_bytes,
        "torch_device": str(rdev.torch_device),
        "memory": rdev.memory(),
        "backend": rdev.backend,
        "host_staging": rdev.host_staging,
        "memory_cap_bytes": cap.cap_bytes if cap else None,
        "peak_live_bytes": ex.peak_live_bytes if cap else None,
        "groups": [setup.plan.groups[g].name for g in sorted(setup.held)],
        "steps": steps,
        "sent_bytes": setup.transport.sent_bytes,
        "split": flow.split,
        "warnings": flow.warnings,
        "training": setup.recipe.describe(_as_held(setup) or None) if rank == 0 else None,  # [train]
        "evaluations": hooks.evaluations,
    }


def _train_step(
    spec: dict[str, Any],
    setup: RankSetup,
    rdev: RankDevice,
    rec: StepRecorder,
    step_log: StepLog,
    step: int,
    progress: Path,
    hooks: TrainingHooks,
) -> dict[str, Any]:
    """One training step of this rank, timed with the rank's clock (CUDA events on a GPU,
    read once the step has finished); its record."""
    rank, ex = setup.rank, setup.interpreter
    progress.write_text(str(step))
    _fault(spec, rank, step)
    batches = hooks.batches(setup.work, setup.plan.batch_size, step, rdev.torch_device)  # [train] --accumulate
    dist.barrier()
    for p in setup.params:
        p.grad = None
    origin, origin_s = ex.clock.mark(), rec.now_s()
    if (spec.get("fault") or {}).get("kind") == "overflow":
        ex.overflow_hook = lambda: _overflow(spec, rank, step, setup.params)
    loss = hooks.train(ex, batches)
    _fault(spec, rank, step, "mid")
    end = ex.clock.mark()
    rdev.synchronize()
    step_time_s = ex.clock.seconds(origin, end)
    spans = ex.read_timings(rank=rank, step=step, origin=origin, origin_s=origin_s)
    rec.add(
        [
            Span(
                name=f"step {step}",
                category=SpanCategory.STEP,
                rank=rank,
                step=step,
                start_s=origin_s,
                end_s=origin_s + step_time_s,
            ),
            *spans,
        ]
    )
    st = ex.stats
    record: dict[str, Any] = {
        "step_time_s": step_time_s,
        "loss": loss,
        "compute_s": st.compute_s,
        "cpu_s": st.cpu_s,
        "paced_s": st.paced_s,
        "recv_wait_s": st.recv_wait_s,
        "sync_s": st.sync_s,
        "loss_scale": ex.scaler.scale if ex.scaler is not None else None,
        "skipped": ex.skipped_steps,
    }
    # the executor's own time: the step less its timed parts (gradient slots, slicing, sends)
    record["other_s"] = step_time_s - sum(record[k] for k in ("compute_s", "paced_s", "recv_wait_s", "sync_s"))
    record.update(  # [train] learning rate, gradient norm, metrics line, evaluation when due
        hooks.after(
            ex, step=step, step_time_s=step_time_s, batches=batches, batch_size=setup.plan.batch_size, work=setup.work
        )
    )
    step_log.append(
        StepRecord(
            step=step,
            rank=rank,
            device=setup.device,
            loss=float(loss),
            step_time_s=step_time_s,
            compute_s=st.compute_s,
            sync_s=st.sync_s,
            recv_wait_s=st.recv_wait_s,
        )
    )
    checkpoint.save_if_due(
        checkpoint.CheckpointConfig.from_dict(spec.get("checkpoint")),
        step + 1,
        setup.named,
        setup.optimizer,
        rank=rank,
        model=setup.plan.model.name,
        servers=setup.sync.served(),
        shards=setup.sync.shards,
    )
    return record


def _report(out_dir: Path, rank: int, work: Callable[[], dict[str, Any]]) -> int:
    """Run `work`; write its result, or the failure for the launcher; the exit code."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = work()
    except BaseException as e:  # report any failure to the launcher, then exit non-zero
        text = str(e).lower()
        kind = (
            "timeout"
            if isinstance(e, RankError) or "timed out" in text or "timeout" in text
            else "peer"
            if ("connection" in text or "peer" in text or "broken pipe" in text)
            else "error"
        )
        write_atomic(
            out_dir / f"error_rank{rank}.json",
            json.dumps(
                {
                    "rank": rank,
                    "kind": kind,
                    "type": type(e).__name__,
                    "message": str(e),
                    "traceback": traceback.format_exc(),
                }
            ),
        )
        return 1
    write_atomic(out_dir / f"result_rank{rank}.json", json.dumps(result))
    return 0


def _store_barrier(store: Any, key: str, world: int, timeout_s: float) -> None:
    """Every process of the launch reaches `key` before any goes on."""
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timedelta(seconds=timeout_s))


def run_plans(spec: dict[str, Any]) -> int:
    """A multi-plan spec (module docstring): each plan in turn, as its rank when the plan's
    `processes` name this process (`spec['rank']`); idle at the barrier after each plan otherwise."""
    me, world = spec["rank"], spec["world"]
    store = dist.TCPStore(
        spec["master_addr"], spec["master_port"], world, is_master=me == 0, timeout=timedelta(seconds=spec["timeout_s"])
    )
    models = ModelCache()
    common = {k: v for k, v in spec.items() if k != "plans"}
    for entry in spec["plans"]:
        processes = entry.get("processes") or list(range(len(entry["devices"])))
        out_dir = Path(entry["out_dir"])
        if me in processes:  # rank of the plan: the place of this process in its list
            plan_spec = {**common, **entry, "rank": processes.index(me)}
            prefixed = dist.PrefixStore(f"plan{entry['index']}/", store)
            if _report(
                out_dir, plan_spec["rank"], functools.partial(train, plan_spec, out_dir, store=prefixed, models=models)
            ):
                return 1
        _store_barrier(store, f"after{entry['index']}", world, entry["wait_s"])
    if me == 0:  # the store lives in this process: leave last
        store.wait([f"left{r}" for r in range(1, world)], timedelta(seconds=spec["timeout_s"]))
    else:
        store.set(f"left{me}", "1")
    return 0


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    if "plans" in spec:
        return run_plans(spec)
    rank = int(os.environ.get("RANK", spec.get("rank", 0)))
    out_dir = Path(spec["out_dir"])
    return _report(out_dir, rank, lambda: train(spec, out_dir))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
