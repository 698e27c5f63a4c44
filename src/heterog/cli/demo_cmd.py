"""`heterog demo`: heterog's plan, the best baseline and even data parallelism measured side by
side on an emulated cluster of unlike devices (heterog/demo.py)."""

from __future__ import annotations

import typer

from heterog.cli.output import WIDE_HELP, console, print_json, print_table, set_wide
from heterog.fmt import human_time


def register(app: typer.Typer) -> None:
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
        _print_demo(result)


def _print_demo(result: dict) -> None:
    """The candidates, predicted vs measured per strategy, the speedups and the plan's notes."""
    print_table(
        f"candidates for {result['model']} {result['model_args']} batch {result['batch_size']} on {result['cluster']}",
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
