"""`heterog run plan.json`: train a plan on local processes (or print the torchrun commands)
and show what was measured beside what was predicted, per rank and per instruction kind."""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from heterog.cli import elastic_opts as eopt
from heterog.cli import training_opts as topt
from heterog.cli.output import WIDE_HELP, console, print_json, print_table, set_wide, write_json
from heterog.execute.preflight import check_data, check_plan_fits_model
from heterog.execute.steplog import read_run, write_jsonl
from heterog.execute.trace import RankSpans, chrome_trace
from heterog.fmt import human_bytes, human_time
from heterog.ir.plan import Plan, user_model_file
from heterog.ir.run_request import (
    CheckpointConfig,
    DeviceLayout,
    Limits,
    LinkConfig,
    OutputConfig,
    PredictionConfig,
    RunOptions,
    TimingConfig,
)
from heterog.ir.run_result import RankSummary, RunResult
from heterog.ir.training_config import TrainingConfig
from heterog.lower.tensor_parallel import runnable


class _StepFollower:
    """Prints one line per step while the ranks run (they append to steps_rank<R>.jsonl), with
    a progress bar on a terminal. A thread, because api.run blocks until the ranks finish."""

    def __init__(self, folder: Path, world_size: int, steps: int, say: Callable[[str], None] | None, bar: bool):
        self.folder, self.world_size, self.steps, self.say = folder, world_size, steps, say
        self.shown = 0
        self.repetition = 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._bar = self._task = None
        if bar and say is not None:
            self._bar = Progress(
                TextColumn("steps"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._task = self._bar.add_task("steps", total=steps)

    def __enter__(self) -> _StepFollower:
        if self._bar is not None:
            self._bar.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the last lines, written just before the ranks exited
        if self._bar is not None:
            self._bar.stop()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def _poll(self) -> None:
        lines = read_run(self.folder, self.world_size)
        if len(lines) < self.shown:  # the ranks of the next repetition started their files afresh
            self.shown = 0
            self.repetition += 1
            if self.say is not None:
                self.say(f"repetition {self.repetition}")
        for line in lines[self.shown :]:
            if self.say is not None:
                text = (
                    f"step {line.step + 1:>{len(str(self.steps))}}/{self.steps}  loss {line.loss:.4f}  "
                    f"step {human_time(line.step_time_s)}  slowest rank {line.slowest_rank} "
                    f"({line.slowest_device})"
                )
                (self._bar.console.print if self._bar is not None else self.say)(text)
            if self._bar is not None and self._task is not None:
                self._bar.update(self._task, completed=line.step + 1)
        self.shown = max(self.shown, len(lines))


def _forget_old_steps(folder: Path) -> None:
    """A --logs folder used before holds the last run's step and trace files: remove them, or
    the follower would print that run's steps before this one's ranks start."""
    for pattern in ("steps_rank*.jsonl", "trace_rank*.json"):
        for old in folder.glob(pattern):
            old.unlink()


def _measured_outputs(result: RunResult, steps_log: Path | None, trace: Path | None) -> None:
    """The per-step lines as JSON lines, and the measured spans as a Chrome trace, when asked."""
    if steps_log is not None:
        write_jsonl(steps_log, result.step_lines)
    if trace is not None:
        recordings = [
            RankSpans(rank=r, device=d, spans=tuple(s for s in result.spans if s.rank == r))
            for r, d in enumerate(result.devices)
        ]
        write_json(str(trace), chrome_trace(recordings))


def _rank_rows(per_rank: tuple[RankSummary, ...]) -> list[list[str]]:
    def mem(n: int | None) -> str:
        return human_bytes(n) if n is not None else "-"

    return [
        [
            str(r.rank),
            r.device,
            f"{r.slowdown:g}×",
            human_time(r.step_time_s),
            human_time(r.compute_s),
            human_time(r.paced_s),
            human_time(r.recv_wait_s),
            human_time(r.sync_s),
            human_time(r.other_s),
            mem(r.measured_peak_memory_bytes),
            mem(r.predicted_peak_memory_bytes),
        ]
        for r in per_rank
    ]


def _signed(seconds: float) -> str:
    return ("+" if seconds >= 0 else "−") + human_time(abs(seconds))


MISS_ROWS = 12  # rows of the per-kind table; --json has them all
WORST_INSTRUCTIONS = 5


def print_instruction_comparison(result: RunResult) -> None:
    """Predicted beside measured per device and instruction kind, the largest misses first,
    then the single instructions that missed most (their ids name them in the Program, the
    simulated trace and the measured one)."""
    rows = result.by_kind()
    if not rows:
        return
    print_table(
        f"per instruction kind and device: predicted vs measured (largest misses first; median of "
        f"{result.measured_steps} steps)",
        ["device", "kind", "count", "predicted", "measured", "miss"],
        [
            [r.device, r.kind, r.count, human_time(r.predicted_s), human_time(r.measured_s), _signed(r.miss_s)]
            for r in rows[:MISS_ROWS]
        ],
    )
    if len(rows) > MISS_ROWS:
        console.print(f"({len(rows) - MISS_ROWS} more rows in --json: by_kind)")
    worst = result.largest_misses(WORST_INSTRUCTIONS)
    print_table(
        "instructions that missed most",
        ["instruction", "what", "predicted", "measured", "miss"],
        [[i.id, i.name, human_time(i.predicted_s), human_time(i.measured_s), _signed(i.miss_s or 0.0)] for i in worst],
    )


# `heterog run`'s options (typer reads them from the annotations)
_Plan = Annotated[Path, typer.Argument(help="A plan file from `heterog plan --out`.")]
_Steps = Annotated[
    int,
    typer.Option(
        "--steps",
        min=1,
        help="Training steps (the first is warm-up); with --resume, the total to reach, counting the checkpoint's.",
    ),
]
_Emulated = Annotated[
    bool,
    typer.Option(
        "--emulated",
        help="Emulate a real GPU cluster's devices with local CPU processes paced by their relative speed.",
    ),
]
_Out = Annotated[
    Path | None, typer.Option("--out", help="Write the run's result here (what `heterog report --run` reads).")
]
_Json = Annotated[bool, typer.Option("--json", help="Print JSON.")]
_Wide = Annotated[bool, typer.Option("--wide", help=WIDE_HELP)]
_Timeout = Annotated[float, typer.Option("--timeout-s", min=0.5, help="Timeout of every collective / transfer.")]
_NoShaping = Annotated[bool, typer.Option("--no-shaping", help="Do not shape links with netns + tc.")]
_PinCores = Annotated[bool, typer.Option("--pin-cores", help="Pin each rank to one core.")]
_Torchrun = Annotated[bool, typer.Option("--torchrun", help="Print the torchrun command per node.")]
_MasterAddr = Annotated[str, typer.Option("--master-addr", help="For --torchrun.")]
_Logs = Annotated[Path | None, typer.Option("--logs", help="Keep the ranks' logs in this folder.")]
_Profile = Annotated[
    bool,
    typer.Option(
        "--profile", help="Predict from per-node times measured on this CPU (emulated clusters; a few seconds more)."
    ),
]
_StepsLog = Annotated[
    Path | None,
    typer.Option("--steps-log", help="Write one JSON line per step (step, loss, step time, slowest rank) here."),
]
_Trace = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Write a Chrome trace of the measured steps per rank (opens in Perfetto beside `simulate --trace`).",
    ),
]
_Data = Annotated[
    str | None,
    typer.Option(
        "--data",
        help="Train on your data: 'path/file.py:loader', loader(batch_size) returning an iterable of global "
        "(inputs, targets) batches, e.g. a DataLoader (docs/robustness.md).",
    ),
]
_CheckpointDir = Annotated[
    Path | None,
    typer.Option("--checkpoint-dir", help="Save model and optimizer state here (with --checkpoint-every)."),
]
_CheckpointEvery = Annotated[int, typer.Option("--checkpoint-every", min=0, help="Save every N steps.")]
_Resume = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        help="Continue from the last complete checkpoint in this folder, under this plan (any plan of the same "
        "model: parameters load by name).",
    ),
]
_Force = Annotated[
    bool,
    typer.Option("--force", help="Start even when the plan's memory per rank exceeds this machine's free memory."),
]
_Repetitions = Annotated[
    int,
    typer.Option(
        "--repetitions",
        min=1,
        help="Run the plan this many times and report the median iteration time and the spread (a noisy machine).",
    ),
]


def run_command(
    ctx: typer.Context,
    plan: _Plan,
    steps: _Steps = 5,
    emulated: _Emulated = False,
    out: _Out = None,
    as_json: _Json = False,
    wide: _Wide = False,
    timeout_s: _Timeout = 60.0,
    no_shaping: _NoShaping = False,
    pin_cores: _PinCores = False,
    torchrun: _Torchrun = False,
    master_addr: _MasterAddr = "NODE0_ADDRESS",
    logs: _Logs = None,
    profile: _Profile = False,
    steps_log: _StepsLog = None,
    trace: _Trace = None,
    data: _Data = None,
    checkpoint_dir: _CheckpointDir = None,
    checkpoint_every: _CheckpointEvery = 0,
    resume: _Resume = None,
    force: _Force = False,
    repetitions: _Repetitions = 1,
    elastic: eopt.Elastic = False,
    elastic_devices: eopt.Devices = None,
    replan_budget_s: eopt.ReplanBudget = 3.0,
    lr: topt.Lr = None,
    weight_decay: topt.WeightDecay = None,
    momentum: topt.Momentum = None,
    betas: topt.Betas = None,
    warmup_steps: topt.WarmupSteps = 0,
    lr_schedule: topt.Schedule = "constant",
    max_grad_norm: topt.MaxGradNorm = None,
    accumulate: topt.Accumulate = 1,
    eval_every: topt.EvalEvery = 0,
    eval_batches: topt.EvalBatches = 4,
    log_dir: topt.LogDir = None,
) -> None:
    """Train a plan for N steps on synthetic data or --data; measured vs predicted step time,
    per rank and per instruction.

    Checks first that the plan fits the model, its cluster, the data and this machine's
    memory; --checkpoint-dir/--checkpoint-every save, --resume continues (docs/robustness.md)."""
    set_wide(wide)
    p = runnable(Plan.load(plan), "heterog run")  # before any rank starts
    training = topt.training_options(ctx.params)  # --data and the training flags (cli/training_opts.py)
    ckpt = CheckpointConfig(
        dir=str(checkpoint_dir) if checkpoint_dir else None,
        every_steps=checkpoint_every,
        resume=str(resume) if resume else None,
    )
    check_plan_fits_model(p)
    check_data(p, data)
    if torchrun:
        _print_torchrun(p, plan, steps, timeout_s, master_addr, as_json, training=training, checkpoint=ckpt)
        return
    if not as_json:
        console.print(f"running {p.strategy} plan of {p.model.name} for {steps} steps …")
    with tempfile.TemporaryDirectory(prefix="heterog-run-") as tmp:
        folder = logs if logs is not None else Path(tmp)
        options = RunOptions(
            steps=steps,
            training=training,
            checkpoint=ckpt,
            timing=TimingConfig(repetitions=repetitions),
            prediction=PredictionConfig(profile=profile),
            layout=DeviceLayout(emulated=emulated, pin_cores=pin_cores),
            links=LinkConfig(shape=False if no_shaping else None),
            limits=Limits(timeout_s=timeout_s, force=force),
            output=OutputConfig(out_dir=str(folder)),
        )
        result = _run_following(p, options, folder, say=None if as_json else console.print, params=ctx.params)
        _measured_outputs(result, steps_log, trace)
    doc = {"kind": result.KIND, "version": result.SCHEMA_VERSION, **result.to_dict()}
    if out:
        write_json(str(out), doc)
    if as_json:
        print_json(doc)
        return
    _print_result(p, result)


def _run_following(
    plan, options: RunOptions, folder: Path, say: Callable[[str], None] | None, params: dict[str, Any]
) -> RunResult:
    """heterog.run, with one line per step printed as the ranks finish it (from `folder`);
    with --elastic, heterog.run_elastic (cli/elastic_opts.py), which prints its own lines."""
    if params.get("elastic"):
        return eopt.run(plan, options, params, say)
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.orchestrate import plan_cluster, rank_devices
    from heterog.runs import run

    _forget_old_steps(folder)
    world_size = len(rank_devices(plan, plan_cluster(plan)))
    with _StepFollower(folder, world_size, options.steps, say, bar=sys.stdout.isatty()):
        return run(plan, options)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)


def _print_result(plan, result: RunResult) -> None:
    """The human view of a run: per rank, per instruction kind, the iteration, the notes."""
    print_table(
        f"{plan.strategy} on {result.cluster}: median step of {result.measured_steps}",
        ["rank", "device", "slow", "step", "compute", "paced", "wait", "sync", "other", "peak mem", "predicted mem"],
        _rank_rows(result.per_rank),
        optional=("paced", "wait", "other", "predicted mem"),
    )
    print_instruction_comparison(result)
    times = result.repetitions_s
    spread = result.spread or 0.0
    console.print(
        f"measured iteration time  {human_time(result.measured_iteration_time_s)}"
        + (
            f" (median of {len(times)} runs, spread {spread:.0%}: {', '.join(human_time(t) for t in times)})"
            if len(times) > 1
            else ""
        )
    )
    err = result.relative_error
    console.print(
        f"predicted iteration time {human_time(result.predicted_iteration_time_s)}  ({result.prediction_source})"
        + (f", error {err:+.1%}" if err is not None else "")
    )
    shaping = result.link_shaping
    console.print(
        "links: "
        + (
            "shaped with netns + tc TBF"
            if shaping.enabled
            else f"not shaped ({shaping.reason or 'single node or disabled'})"
        )
    )
    for evaluation in result.evaluations:  # --eval-every
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in evaluation.items() if k != "step")
        console.print(f"evaluation after step {evaluation['step']}: {shown}")
    for n in result.notes:
        console.print(f"note: {n}")
    for line in result.provenance():  # where it resumed from, its re-plans
        console.print(line)


def _print_torchrun(
    plan,
    plan_path: Path,
    steps: int,
    timeout_s: float,
    master_addr: str,
    as_json: bool,
    *,
    training: TrainingConfig,
    checkpoint: CheckpointConfig | None = None,
) -> None:
    """Write the ranks' spec next to the plan and print one torchrun command per node."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.execute.device import nccl_env
    from heterog.execute.spec import RankSpec
    from heterog.execute.torchrun import local_gpu_indices, torchrun_commands
    from heterog.orchestrate import lower, plan_cluster, rank_devices
    from heterog.runs.api import checked_training

    cluster = plan_cluster(plan)
    devices = rank_devices(plan, cluster)
    if cluster is None:
        node_devices = [list(devices)]
        visible = None
    else:
        used_nodes = [n for n in cluster.nodes if any(d in devices for d in n.devices)]
        node_devices = [[d for d in n.devices if d in devices] for n in used_nodes]
        visible = [local_gpu_indices(n.devices, used) for n, used in zip(used_nodes, node_devices)]
    gpu_types = {d: cluster.device(d).gpu_type for d in devices} if cluster and cluster.kind != "emulated" else {}
    gpus = bool(gpu_types)  # ranks on cuda:<local rank>, NCCL
    env, note = nccl_env(set(gpu_types.values())) if gpus else ({}, None)
    spec_path = plan_path.with_suffix(".torchrun.json")
    RankSpec(
        program=lower(plan).to_dict(),
        torchrun=True,
        node_devices=tuple(tuple(n) for n in node_devices),
        cuda=gpus,
        gpu_types=gpu_types,
        steps=steps,
        timeout_s=timeout_s,
        out_dir="heterog-run",
        training=checked_training(plan, training, steps),
        checkpoint=checkpoint or CheckpointConfig(),
    ).save(spec_path)
    cmds = torchrun_commands(
        spec_path=str(spec_path),
        node_devices=node_devices,
        master_addr=master_addr,
        env=env,
        visible=visible if gpus else None,
    )
    if note and not as_json:
        console.print(note)
    files = _files_every_node_needs(plan, spec_path, training.data)
    if as_json:
        print_json({"spec": str(spec_path), "commands": cmds, "files_every_node_needs": files})
        return
    console.print(
        f"ranks' spec written to {spec_path}; every node needs, at these paths: {', '.join(files)}"
        + (
            " (and --checkpoint-dir/--resume on a shared file system)"
            if checkpoint is not None and checkpoint.active
            else ""
        )
        + ". Then run:"
    )
    for i, c in enumerate(cmds):
        console.print(f"# node {i} ({', '.join(node_devices[i])})\n{c}")


def _files_every_node_needs(plan, spec_path: Path, data: str | None) -> list[str]:
    """The spec, and the user's model and data files the ranks import (absolute paths)."""
    files = [str(spec_path.resolve())]
    if plan.model.file:
        files.append(plan.model.file)
    user = user_model_file(data or "")
    if user is not None:
        files.append(str(Path(user[0]).resolve()))
    return files
