"""`heterog plan` (find the best deployment) and `heterog train-policy` (train the GNN policy)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from heterog.cli.objective_opts import (
    MAX_COST_OPTION,
    OBJECTIVE_OPTION,
    PRICE_OPTION,
    TOLERANCE_OPTION,
    cost_cells,
    cost_headers,
    cost_line,
    objective_inputs,
)
from heterog.cli.output import console, parse_model_args, print_json, print_table
from heterog.cli.report_cmd import report_from_plan_result
from heterog.cli.stop import raise_if_stopped
from heterog.cli.three_d_opts import (
    DEVICES_OPTION,
    DP_OPTION,
    GRID,
    MICROBATCHES_OPTION,
    PP_OPTION,
    SCHEDULE_OPTION,
    STAGE_LAYERS_OPTION,
    STRATEGY,
    STRATEGY_OPTION,
    TENSOR_PARALLEL_OPTION,
    TP_OPTION,
    ZERO_OPTION,
    check_3d_options,
    write_fixed,
)
from heterog.errors import did_you_mean
from heterog.fmt import human_bytes, human_time
from heterog.hardware.catalog import precision_help
from heterog.ir.plan import OPTIMIZERS, PRECISIONS, Plan


def _progress_bar(enabled: bool):
    """A rich progress bar on a terminal (never in --json); either way a callback that stops
    the search when a stop signal arrived (cli/stop.py raise_if_stopped)."""
    if not enabled:
        return None, lambda stage, frac: raise_if_stopped()
    bar = Progress(
        TextColumn("{task.description:<12}"), BarColumn(), TimeElapsedColumn(), console=console, transient=True
    )
    task = bar.add_task("planning", total=1.0)

    def update(stage: str, frac: float) -> None:
        raise_if_stopped()
        bar.update(task, completed=frac, description=stage)

    return bar, update


_TIME_WORDS = {
    "graph": "graph",
    "cluster_and_costs": "cluster and costs",
    "cut_analysis": "what the executor can cut",
    "grouping": "grouping",
    "baselines": "baselines",
    "bound": "bound",
    "subsets": "fewer devices",
    "lanes": "search",
    "explanation": "explanation",
}


def process_age_s() -> float:
    """Seconds since this process started (interpreter, imports and all)."""
    return time.time() - psutil.Process().create_time()


def _time_line(result: dict[str, Any], budget_s: float) -> str:
    """Where the command's time went, stage by stage, against --budget-s (which bounds them
    all; start-up and imports come before its clock starts)."""
    stages = result.get("time_s") or {**result.get("other_time_s", {}), "lanes": result["search_time_s"]}
    parts = []
    for key, seconds in stages.items():
        if seconds < 0.05 and key not in ("graph", "lanes"):
            continue
        word = _TIME_WORDS.get(key, key)
        if key == "graph":
            word += f" ({'cached' if result.get('graph_cache') == 'hit' else 'captured'})"
        elif key == "lanes":
            lanes = list(result.get("lanes", {}))
            parallel = result.get("budget_split", {}).get("parallel")
            if lanes:
                word += f" ({(' ∥ ' if parallel else ' then ').join(lanes)})"
        parts.append(f"{word} {seconds:.1f} s")
    planned = sum(stages.values())
    line = f"planned in {planned:.1f} s of --budget-s {budget_s:g}: " + ", ".join(parts)
    total = result.get("wall_time_s")
    if total is not None:
        line += f"; start-up and imports {max(total - planned, 0.0):.1f} s; {total:.1f} s in all"
    return line


def _above(c: dict[str, Any]) -> str:
    x = c.get("above_bound")
    return "—" if x is None or not c["feasible"] else f"+{x * 100:.0f} %"


def _show(result: dict[str, Any], budget_s: float) -> None:
    rows = []
    priced = any(c.get("cost") for c in result["candidates"])
    tokens = bool(result["best"]["model"].get("seq_len"))
    for c in result["candidates"]:
        peak = max(c["peak_memory_bytes"].values(), default=0)
        rows.append(
            [
                c["strategy"],
                human_time(c["iteration_time_s"]) if c["feasible"] else "—",
                _above(c),
                "yes" if c["feasible"] else "no (memory)",
                c["devices_used"],
                c["num_microbatches"],
                human_bytes(peak),
                *(cost_cells(c, tokens) if priced else []),
            ]
        )
    print_table(
        "candidates",
        ["strategy", "iteration", "over bound", "fits", "devices", "micro-batches", "max peak memory"]
        + (cost_headers(tokens) if priced else []),
        rows,
        optional=("micro-batches", "over bound", "$/step", "$/hour", "max peak memory"),
    )
    best = result["best"]
    line = f"[bold]best: {best['strategy']}[/bold] — {human_time(best['predicted_iteration_time_s'])} per iteration"
    bound = result.get("bound")
    if bound and not bound.get("tensor_parallel") and any("tp_devices" in g for g in best["groups"]):
        line += " (no lower bound: it was computed for plans without tensor parallelism)"
    elif bound:
        t = best["predicted_iteration_time_s"]
        line += f", within {(t / bound['iteration_time_s'] - 1) * 100:.0f} % of the lower bound "
        line += human_time(bound["iteration_time_s"])
        from heterog.search.bound import Bound  # here: the search's imports stay out of the CLI's start

        if (floor := Bound.from_dict(bound).floor_s) is not None:
            line += f" ({(t / floor - 1) * 100:+.0f} % against plain data parallelism's floor {human_time(floor)})"
    console.print(line + cost_line(best))
    console.print(_time_line(result, budget_s))
    for line in best["notes"]:
        console.print(f"  • {line}")


PROFILE_HELP = (
    "A `heterog profile` file for one device type, FILE or FILE:TYPE (repeatable, one per type): its per-node "
    "times replace the estimate where they measured, and a GPU's profile calibrates its type; TYPE: the cluster "
    "type it stands for (default: the type it was measured on)."
)
BUDGET_HELP = (
    "Seconds for the whole plan: capture, costs, baselines, bound and search (start-up aside). "
    "A larger budget with the same --seed never gives a worse plan."
)
FINETUNE_OPTION = typer.Option(
    0.0, "--finetune-s", min=0.0, help="Fine-tune the GNN on this problem for this many seconds first."
)
REPORT_OPTION = typer.Option(
    None, "--report", help="Also write an HTML report of the plan and every candidate here (see `heterog report`)."
)
MAX_ITERS_HELP = (
    "Cap each search at this many moves: with --seed, the same plan on any machine (the budget is then a safety stop)."
)


def plan_command(
    model: str = typer.Option(..., "--model", help="Zoo model name or path/file.py:factory."),
    model_arg: list[str] | None = typer.Option(None, "--model-arg", help="Model argument key=value (repeatable)."),
    batch_size: int = typer.Option(..., "--batch-size", min=1, help="Global batch size of one iteration."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Sequence length (language models)."),
    cluster: str = typer.Option(..., "--cluster", help="Cluster YAML file or built-in name (e.g. paper-8gpu)."),
    precision: str = typer.Option("fp32", "--precision", help=precision_help()),
    optimizer: str = typer.Option("sgd", "--optimizer", help="sgd or adamw."),
    budget_s: float = typer.Option(10.0, "--budget-s", min=0.1, help=BUDGET_HELP),
    seed: int = typer.Option(0, "--seed", help="Random seed of the search."),
    max_iters: int | None = typer.Option(None, "--max-iters", min=1, help=MAX_ITERS_HELP),
    policy: Path | None = typer.Option(None, "--policy", help="GNN policy file (default: the shipped one)."),
    no_gnn: bool = typer.Option(False, "--no-gnn", help="Skip the GNN policy candidates."),
    finetune_s: float = FINETUNE_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document, no progress bar."),
    out: Path | None = typer.Option(None, "--out", help="Write the best plan here (heterog simulate/run read it)."),
    profile: list[str] | None = typer.Option(None, "--profile", help=PROFILE_HELP),
    strategy: str | None = STRATEGY_OPTION,
    tp: int | None = TP_OPTION,
    pp: int | None = PP_OPTION,
    dp: int | None = DP_OPTION,
    stage_layers: str | None = STAGE_LAYERS_OPTION,
    microbatches: int = MICROBATCHES_OPTION,
    schedule: str = SCHEDULE_OPTION,
    zero: int = ZERO_OPTION,
    devices: str | None = DEVICES_OPTION,
    tensor_parallel: bool = TENSOR_PARALLEL_OPTION,
    report: Path | None = REPORT_OPTION,
    objective: str = OBJECTIVE_OPTION,
    max_cost_per_hour: float | None = MAX_COST_OPTION,
    tolerance: float | None = TOLERANCE_OPTION,
    price: list[str] | None = PRICE_OPTION,
) -> None:
    """Find the fastest deployment of MODEL on CLUSTER that fits in memory; compare it with the baselines."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.plan_module import plan

    shape = {"tp": tp, "pp": pp, "dp": dp, "stage_layers": stage_layers, "devices": devices}
    check_3d_options(strategy, shape)
    if strategy in (STRATEGY, GRID):
        _check_choices(precision, optimizer, None)
        inputs = {"model": model, "cluster": cluster, "batch_size": batch_size, "seq_len": seq_len}
        inputs |= {"model_args": parse_model_args(model_arg), "precision": precision, "optimizer": optimizer}
        shape |= {"microbatches": microbatches, "schedule": schedule, "zero": zero}
        return write_fixed(strategy, inputs, shape, budget_s=budget_s, out=out, as_json=as_json)
    _check_choices(precision, optimizer, strategy)
    goal, cluster_in = objective_inputs(objective, max_cost_per_hour, tolerance, price, cluster)
    bar, update = _progress_bar(not as_json and sys.stdout.isatty())
    with bar if bar is not None else contextlib.nullcontext():
        result = plan(
            model,
            model_args=parse_model_args(model_arg),
            batch_size=batch_size,
            seq_len=seq_len,
            cluster=cluster_in,
            precision=precision,
            optimizer=optimizer,
            budget_s=budget_s,
            seed=seed,
            policy=False if no_gnn else policy,
            finetune_s=finetune_s,
            max_iters=max_iters,
            progress=update,
            strategy=strategy,
            profile=profile,
            goal=goal,
            tensor_parallel="any" if tensor_parallel else "none",
        )
    result["wall_time_s"] = process_age_s()  # start to plan, for the time line (not the report)
    _deliver(result, budget_s, out=out, report=report, profile=profile, as_json=as_json, strategy=strategy)


def _deliver(result: dict, budget_s: float, *, out, report, profile, as_json: bool, strategy: str | None) -> None:
    """The plan written (--out), its report (--report), then the result shown or printed as JSON."""
    if out is not None:
        Plan.from_dict(result.get("chosen", result["best"])).save(out)
    if report is not None:
        report_from_plan_result(result, report, profile)
    if as_json:
        print_json(result)
        return
    _show(result, budget_s)
    if out is not None:
        console.print(f"plan{f' of {strategy!r}' if strategy else ''} written to {out}")
    if report is not None:
        console.print(f"report written to {report}")


def _check_choices(precision: str, optimizer: str, strategy: str | None) -> None:
    """The options with a fixed set of values, checked before the search, not after it."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.search.planner import CANDIDATES

    if precision not in PRECISIONS:
        raise typer.BadParameter(f"--precision must be one of {', '.join(PRECISIONS)}.")
    if optimizer not in OPTIMIZERS:
        raise typer.BadParameter(f"--optimizer must be one of {', '.join(OPTIMIZERS)}.")
    if strategy is not None and strategy not in CANDIDATES and not strategy.startswith("subset:"):
        raise typer.BadParameter(
            f"no strategy {strategy!r}.{did_you_mean(strategy, CANDIDATES)} The "
            f"candidates are {', '.join(CANDIDATES)}.",
            param_hint="--strategy",
        )


def train_policy_command(
    steps: int = typer.Option(400, "--steps", min=1, help="Policy-gradient steps."),
    problems: int = typer.Option(24, "--problems", min=1, help="Synthetic training problems."),
    max_devices: int = typer.Option(8, "--max-devices", min=2, help="Largest synthetic cluster."),
    seed: int = typer.Option(0, "--seed"),
    budget_s: float | None = typer.Option(None, "--budget-s", help="Stop after this many seconds."),
    zoo: str | None = typer.Option(
        None,
        "--zoo",
        help="Also train on these zoo models, comma-separated "
        "name:batch[:seq_len] ('default' = resnet50, vit_b_16, gpt2, toy-cnn, mlp).",
    ),
    clusters: str = typer.Option("paper-8gpu,mixed-16", "--clusters", help="Clusters for the --zoo problems."),
    init: Path | None = typer.Option(None, "--init", help="Fine-tune this policy file instead of starting fresh."),
    out: Path = typer.Option(Path("policy.pt"), "--out", help="Where to save the trained policy."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Train the GNN placement policy by REINFORCE on synthetic problems and save it."""
    # imported when the command runs: `heterog --help` starts without numpy or torch
    from heterog.search.gnn.policy import load_policy, new_policy
    from heterog.search.gnn.train import DEFAULT_ZOO, TrainConfig, mean_reward, synthetic_problems, train, zoo_problems

    pol = load_policy(init) if init is not None else new_policy(seed=seed)
    assert pol is not None  # load_policy returns None only when given no file
    probs = synthetic_problems(problems, seed=seed, max_devices=max_devices)
    if zoo:
        models = DEFAULT_ZOO if zoo == "default" else [m.strip() for m in zoo.split(",") if m.strip()]
        probs += zoo_problems(models, [c.strip() for c in clusters.split(",") if c.strip()])
        pol.meta["zoo"] = list(models)
    held_out = synthetic_problems(4, seed=seed + 10_000, max_devices=max_devices)
    before = sum(mean_reward(pol, p) for p in held_out) / len(held_out)

    def log(rec: dict) -> None:
        if not as_json and rec["step"] % 25 == 0:
            console.print(f"step {rec['step']:4d}  problem {rec['problem']:3d}  mean reward {rec['mean_reward']:.3f}")

    history = train(pol, probs, TrainConfig(steps=steps, seed=seed), budget_s=budget_s, log=log)
    after = sum(mean_reward(pol, p) for p in held_out) / len(held_out)
    pol.meta.update({"held_out_reward_before": before, "held_out_reward_after": after})
    pol.save(out)
    summary = {
        "out": str(out),
        "steps": len(history),
        "problems": len(probs),
        "held_out_mean_reward_before": before,
        "held_out_mean_reward_after": after,
        "train_time_s": pol.meta.get("train_time_s"),
    }
    if as_json:
        print_json(summary)
    else:
        console.print(
            f"saved {out}: {len(history)} steps; held-out mean reward {before:.3f} → {after:.3f} "
            f"(−sqrt(time / best baseline); −1 matches the best baseline)"
        )


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
    app.command("train-policy")(train_policy_command)
