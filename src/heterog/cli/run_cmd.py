"""`heterog run plan.json` and `heterog demo`."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from heterog.cli import training_opts as topt
from heterog.cli.output import WIDE_HELP, console, print_json, print_table, set_wide, write_json
from heterog.execute.preflight import check_data, check_plan_fits_model
from heterog.execute.steplog import TRACE_FILE, read_run, write_jsonl
from heterog.execute.trace import RankSpans, chrome_trace
from heterog.fmt import human_bytes, human_time
from heterog.ir.plan import Plan, user_model_file
from heterog.jsonio import write_atomic


class _StepFollower:
    """Prints one line per step while the ranks run (they append to steps_rank<R>.jsonl), with
    a progress bar on a terminal. A thread, because api.run blocks until the ranks finish."""

    def __init__(self, folder: Path, world_size: int, steps: int, say: Callable[[str], None] | None, bar: bool):
        self.folder, self.world_size, self.steps, self.say = folder, world_size, steps, say
        self.shown = 0
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
        for line in lines[self.shown :]:
            if self.say is not None:
                text = (
                    f"step {line.step + 1:>{len(str(self.steps))}}/{self.steps}  loss {line.loss:.4f}  "
                    f"step {human_time(line.step_time_s)}  slowest rank {line.slowest_rank} "
                    f"({line.slowest_device})"
                )
                (self._bar.console.print if self._bar is not None else self.say)(text)
            if self._bar is not None:
                self._bar.update(self._task, completed=line.step + 1)
        self.shown = max(self.shown, len(lines))


def _forget_old_steps(folder: Path) -> None:
    """A --logs folder used before holds the last run's step and trace files: remove them, or
    the follower would print that run's steps before this one's ranks start."""
    for pattern in ("steps_rank*.jsonl", "trace_rank*.json"):
        for old in folder.glob(pattern):
            old.unlink()


def _measured_outputs(folder: Path, world_size: int, result: dict, steps_log: Path | None, trace: Path | None) -> None:
    """Add the per-step lines and the measured spans to `result` (so a report can draw the
    measured timeline) and write the JSON-lines file and the Chrome trace when asked."""
    lines = read_run(folder, world_size)
    result["step_lines"] = [line.to_dict() for line in lines]
    recordings = []
    for rank in range(world_size):
        path = folder / TRACE_FILE.format(rank=rank)
        if path.exists():
            recordings.append(RankSpans.from_dict(json.loads(path.read_text())))
    result["spans"] = [{**s.to_dict(), "device": r.device} for r in recordings for s in r.spans]
    if steps_log is not None:
        write_jsonl(steps_log, lines)
    if trace is not None:
        write_json(str(trace), chrome_trace(recordings))


def _rank_rows(per_rank: list[dict]) -> list[list[str]]:
    def mem(n):
        return human_bytes(n) if n is not None else "-"

    return [
        [
            str(r["rank"]),
            r["device"],
            f"{r['slowdown']:g}×",
            human_time(r["step_time_s"]),
            human_time(r["compute_s"]),
            human_time(r["paced_s"]),
            human_time(r["recv_wait_s"]),
            human_time(r["sync_s"]),
            human_time(r.get("other_s")),
            # a GPU's allocator peak, or an emulated device's live tensors (emulation.py)
            mem(r.get("peak_allocated_bytes") or r.get("peak_live_bytes")),
            mem(r.get("predicted_peak_memory_bytes")),
        ]
        for r in per_rank
    ]


def _with_repetitions(result: dict, times: list[float], predicted: float | None) -> None:
    """The result of several runs of one plan: the median iteration time, each run's, and the
    spread (slowest / fastest − 1); the prediction of the first run (profiled once)."""
    result["repetitions_s"] = times
    result["measured_iteration_time_s"] = statistics.median(times)
    result["spread"] = max(times) / min(times) - 1.0
    result["predicted_iteration_time_s"] = predicted
    result["relative_error"] = (result["measured_iteration_time_s"] - predicted) / predicted if predicted else None


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        plan: Path = typer.Argument(..., help="A plan file from `heterog plan --out`."),
        steps: int = typer.Option(
            5,
            "--steps",
            min=1,
            help="Training steps (the first is warm-up); with --resume, the total to reach, counting the checkpoint's.",
        ),
        emulated: bool = typer.Option(
            False,
            "--emulated",
            help="Emulate a real GPU cluster's devices with local CPU processes paced by their relative speed.",
        ),
        out: Path | None = typer.Option(None, "--out", help="Write the result JSON here."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
        timeout_s: float = typer.Option(60.0, "--timeout-s", min=0.5, help="Timeout of every collective / transfer."),
        no_shaping: bool = typer.Option(False, "--no-shaping", help="Do not shape links with netns + tc."),
        pin_cores: bool = typer.Option(False, "--pin-cores", help="Pin each rank to one core."),
        torchrun: bool = typer.Option(False, "--torchrun", help="Print the torchrun command per node."),
        master_addr: str = typer.Option("NODE0_ADDRESS", "--master-addr", help="For --torchrun."),
        logs: Path | None = typer.Option(None, "--logs", help="Keep the ranks' logs in this folder."),
        profile: bool = typer.Option(
            False,
            "--profile",
            help="Predict from per-node times measured on this CPU (emulated clusters; a few seconds more).",
        ),
        steps_log: Path | None = typer.Option(
            None, "--steps-log", help="Write one JSON line per step (step, loss, step time, slowest rank) here."
        ),
        trace: Path | None = typer.Option(
            None,
            "--trace",
            help="Write a Chrome trace of the measured steps per rank (opens in Perfetto beside `simulate --trace`).",
        ),
        data: str | None = typer.Option(
            None,
            "--data",
            help="Train on your data: 'path/file.py:loader', "
            "loader(batch_size) returning an iterable of global (inputs, "
            "targets) batches, e.g. a DataLoader (docs/robustness.md).",
        ),
        checkpoint_dir: Path | None = typer.Option(
            None, "--checkpoint-dir", help="Save model and optimizer state here (with --checkpoint-every)."
        ),
        checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="Save every N steps."),
        resume: Path | None = typer.Option(
            None,
            "--resume",
            help="Continue from the last complete "
            "checkpoint in this folder, under this plan (any plan of "
            "the same model: parameters load by name).",
        ),
        force: bool = typer.Option(
            False, "--force", help="Start even when the plan's memory per rank exceeds this machine's free memory."
        ),
        repetitions: int = typer.Option(
            1,
            "--repetitions",
            min=1,
            help="Run the plan this many times and report the median iteration time and the spread (a noisy machine).",
        ),
        lr: float | None = topt.LR,
        weight_decay: float | None = topt.WEIGHT_DECAY,
        momentum: float | None = topt.MOMENTUM,
        betas: str | None = topt.BETAS,
        warmup_steps: int = topt.WARMUP_STEPS,
        lr_schedule: str = topt.LR_SCHEDULE,
        max_grad_norm: float | None = topt.MAX_GRAD_NORM,
        accumulate: int = topt.ACCUMULATE,
        eval_every: int = topt.EVAL_EVERY,
        eval_batches: int = topt.EVAL_BATCHES,
        log_dir: Path | None = topt.LOG_DIR,
    ) -> None:
        """Train a plan for N steps on synthetic data or --data; measured vs predicted step time.

        Checks first that the plan fits the model, its cluster, the data and this machine's
        memory; --checkpoint-dir/--checkpoint-every save, --resume continues (docs/robustness.md)."""
        set_wide(wide)
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog import pipeline as api
        from heterog.execute.checkpoint import CheckpointConfig

        p = Plan.load(plan)
        ckpt = CheckpointConfig(
            dir=str(checkpoint_dir) if checkpoint_dir else None,
            every_steps=checkpoint_every,
            resume=str(resume) if resume else None,
        )
        training = topt.training_options(  # [train] the user's optimizer, schedule, clipping, evaluation, metrics
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            betas=betas,
            warmup_steps=warmup_steps,
            lr_schedule=lr_schedule,
            max_grad_norm=max_grad_norm,
            accumulate=accumulate,
            eval_every=eval_every,
            eval_batches=eval_batches,
            log_dir=str(log_dir) if log_dir else None,
        )
        check_plan_fits_model(p)
        check_data(p, data)
        if torchrun:
            _print_torchrun(
                p, plan, steps, timeout_s, master_addr, as_json, data=data, checkpoint=ckpt.to_dict(), training=training
            )
            return
        if not as_json:
            console.print(f"running {p.strategy} plan of {p.model.name} for {steps} steps …")
        world_size = len(api.rank_devices(p, api.plan_cluster(p)))
        with tempfile.TemporaryDirectory(prefix="heterog-run-") as tmp:
            folder = logs if logs is not None else Path(tmp)
            say = None if as_json else console.print
            times, predicted = [], None
            for rep in range(repetitions):
                if repetitions > 1 and say is not None:
                    say(f"repetition {rep + 1}/{repetitions}")
                _forget_old_steps(folder)
                with _StepFollower(folder, world_size, steps, say, bar=sys.stdout.isatty()):
                    result = api.run(
                        p,
                        steps=steps,
                        emulated=emulated,
                        timeout_s=timeout_s,
                        shape_links=False if no_shaping else None,
                        pin_cores=pin_cores,
                        out_dir=folder,
                        profile=profile and rep == 0,
                        data=data,
                        checkpoint=ckpt.to_dict(),
                        force=force,
                        training=training,
                    )
                times.append(result["measured_iteration_time_s"])
                if rep == 0:
                    predicted = result["predicted_iteration_time_s"]
            _with_repetitions(result, times, predicted)
            _measured_outputs(folder, world_size, result, steps_log, trace)
        if out:
            write_json(str(out), result)
        if as_json:
            print_json(result)
            return
        print_table(
            f"{p.strategy} on {result['cluster']}: median step of {result['measured_steps']}",
            [
                "rank",
                "device",
                "slow",
                "step",
                "compute",
                "paced",
                "wait",
                "sync",
                "other",
                "peak mem",
                "predicted mem",
            ],
            _rank_rows(result["per_rank"]),
            optional=("paced", "wait", "other", "predicted mem"),
        )
        pred = result["predicted_iteration_time_s"]
        err = result["relative_error"]
        console.print(
            f"measured iteration time  {human_time(result['measured_iteration_time_s'])}"
            + (
                f" (median of {repetitions} runs, spread {result['spread']:.0%}: "
                f"{', '.join(human_time(t) for t in times)})"
                if repetitions > 1
                else ""
            )
        )
        console.print(
            f"predicted iteration time {human_time(pred)}  ({result['prediction_source']})"
            + (f", error {err:+.1%}" if err is not None else "")
        )
        shaping = result["link_shaping"]
        console.print(
            "links: "
            + (
                "shaped with netns + tc TBF"
                if shaping.get("enabled")
                else f"not shaped ({shaping.get('reason', 'single node or disabled')})"
            )
        )
        for evaluation in result.get("evaluations", []):  # [train] --eval-every
            step = evaluation["step"]
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in evaluation.items() if k != "step")
            console.print(f"evaluation after step {step}: {shown}")
        for n in result["notes"]:
            console.print(f"note: {n}")

    @app.command("demo")
    def demo_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
        steps: int = typer.Option(8, "--steps", help="Training steps per strategy (first is warm-up)."),
        budget_s: float = typer.Option(5.0, "--budget-s", help="Planner time budget."),
        no_profile: bool = typer.Option(
            False, "--no-profile", help="Predict with the analytic model only (no measured profile)."
        ),
        repetitions: int = typer.Option(
            5, "--repetitions", min=1, help="Measure each strategy this many times, interleaved."
        ),
        scenario: str = typer.Option(
            "",
            "--scenario",
            help="One of heterog.demo.SCENARIOS (default: the "
            "one that shows heterog best; benchmarks/run_vs_sim.py runs them all).",
        ),
    ) -> None:
        """Plan a zoo model on an emulated 3-device cluster whose devices differ in speed, links and
        memory; run heterog's plan, the best baseline and even DP (interleaved repetitions);
        compare predicted with measured."""
        set_wide(wide)
        # imported when the command runs: `heterog --help` starts without numpy or torch
        from heterog.demo import DEMO_SCENARIO, SCENARIOS, demo

        if scenario and scenario not in SCENARIOS:
            raise typer.BadParameter(
                f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}.", param_hint="--scenario"
            )
        say = (lambda s: None) if as_json else (lambda s: console.print(f"[dim]{s}[/dim]"))
        result = demo(
            steps=steps,
            budget_s=budget_s,
            profile=not no_profile,
            repetitions=repetitions,
            scenario=scenario or DEMO_SCENARIO,
            say=say,
        )
        if as_json:
            print_json(result)
            return
        print_table(
            f"candidates for {result['model']} {result['model_args']} batch {result['batch_size']} "
            f"on {result['cluster']}",
            ["strategy", "predicted iteration", "feasible", "devices", "micro-batches"],
            [
                [
                    c["strategy"],
                    human_time(c["iteration_time_s"]),
                    "yes" if c["feasible"] else "no",
                    c["devices_used"],
                    c["num_microbatches"],
                ]
                for c in result["candidates"]
            ],
        )
        print_table(
            f"predicted vs measured (median of {result['repetitions']} interleaved repetitions)",
            ["strategy", "plan", "predicted", "measured", "spread", "error"],
            [
                [
                    k,
                    v["strategy"],
                    human_time(v["predicted_iteration_time_s"]),
                    human_time(v["measured_iteration_time_s"]),
                    f"{v['spread']:.0%}",
                    f"{v['relative_error']:+.1%}",
                ]
                for k, v in result["strategies"].items()
            ],
        )
        for base, key in (
            ("even data parallelism", "speedup_vs_even_dp"),
            ("the best baseline", "speedup_vs_best_baseline"),
        ):
            sp = result[key]
            if sp is None:
                console.print(f"speedup of heterog over {base}: n/a (it does not fit the cluster's memory)")
                continue
            verdict = "holds at the worst repetition" if sp["holds"] else "not claimed: not at every repetition"
            console.print(
                f"speedup of heterog over {base}: {sp['median']:.2f}× (worst {sp['worst']:.2f}×, "
                f"predicted {sp['predicted']:.2f}×) — {verdict}"
            )
        for n in result["best_plan_notes"]:
            console.print(f"· {n}")


def _print_torchrun(
    plan,
    plan_path: Path,
    steps: int,
    timeout_s: float,
    master_addr: str,
    as_json: bool,
    *,
    data: str | None = None,
    checkpoint: dict | None = None,
    training: dict | None = None,
) -> None:
    """Write the ranks' spec next to the plan and print one torchrun command per node."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.execute.launcher import local_gpu_indices, torchrun_commands
    from heterog.pipeline import plan_cluster, rank_devices

    cluster = plan_cluster(plan)
    devices = rank_devices(plan, cluster)
    if cluster is None:
        node_devices = [list(devices)]
        visible = None
    else:
        used_nodes = [n for n in cluster.nodes if any(d in devices for d in n.devices)]
        node_devices = [[d for d in n.devices if d in devices] for n in used_nodes]
        visible = [local_gpu_indices(n.devices, used) for n, used in zip(used_nodes, node_devices)]
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.execute.device import nccl_env
    from heterog.pipeline import checked_training, lower

    gpus = cluster is not None and cluster.kind != "emulated"  # ranks on cuda:<local rank>, NCCL
    env, note = nccl_env({cluster.device(d).gpu_type for d in devices}) if gpus else ({}, None)
    spec_path = plan_path.with_suffix(".torchrun.json")
    gpu_types = {d: cluster.device(d).gpu_type for d in devices} if gpus else {}
    write_atomic(
        spec_path,
        json.dumps(
            {
                "torchrun": True,
                "program": lower(plan).to_dict(),
                "node_devices": node_devices,
                "cuda": gpus,
                "gpu_types": gpu_types,
                "steps": steps,
                "timeout_s": timeout_s,
                "out_dir": "heterog-run",
                "data": data,
                "checkpoint": checkpoint,
                "training": checked_training(plan, training, steps, data),
            }
        ),
    )
    cmds = torchrun_commands(
        spec_path=str(spec_path),
        node_devices=node_devices,
        master_addr=master_addr,
        env=env,
        visible=visible if gpus else None,
    )
    if note and not as_json:
        console.print(note)
    files = _files_every_node_needs(plan, spec_path, data)
    if as_json:
        print_json({"spec": str(spec_path), "commands": cmds, "files_every_node_needs": files})
        return
    console.print(
        f"ranks' spec written to {spec_path}; every node needs, at these paths: {', '.join(files)}"
        + (
            " (and --checkpoint-dir/--resume on a shared file system)"
            if checkpoint and (checkpoint.get("dir") or checkpoint.get("resume"))
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
