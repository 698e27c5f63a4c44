"""`heterog run plan.json` and `heterog demo`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from heterog.cli.output import console, human_time, print_json, print_table, write_json


def _rank_rows(per_rank: list[dict]) -> list[list[str]]:
    return [[str(r["rank"]), r["device"], f"{r['slowdown']:g}×", human_time(r["step_time_s"]),
             human_time(r["compute_s"]), human_time(r["paced_s"]), human_time(r["recv_wait_s"]),
             human_time(r["sync_s"])] for r in per_rank]


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        plan: Path = typer.Argument(..., help="A plan file from `heterog plan --out`."),
        steps: int = typer.Option(5, "--steps", help="Training steps (the first is warm-up)."),
        emulated: bool = typer.Option(False, "--emulated", help="Emulate a real GPU cluster's devices "
                                      "with local CPU processes paced by their relative speed."),
        out: Optional[Path] = typer.Option(None, "--out", help="Write the result JSON here."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        timeout_s: float = typer.Option(60.0, "--timeout-s", help="Timeout of every collective / transfer."),
        no_shaping: bool = typer.Option(False, "--no-shaping", help="Do not shape links with netns + tc."),
        pin_cores: bool = typer.Option(False, "--pin-cores", help="Pin each rank to one core."),
        torchrun: bool = typer.Option(False, "--torchrun", help="Print the torchrun command per node."),
        master_addr: str = typer.Option("NODE0_ADDRESS", "--master-addr", help="For --torchrun."),
        logs: Optional[Path] = typer.Option(None, "--logs", help="Keep the ranks' logs in this folder."),
        profile: bool = typer.Option(False, "--profile", help="Predict from per-node times measured on "
                                     "this CPU (emulated clusters; a few seconds more)."),
    ) -> None:
        """Train a plan for N steps on synthetic data; measured vs predicted step time."""
        from heterog.execute import api
        from heterog.ir.plan import Plan

        p = Plan.load(plan)
        if torchrun:
            _print_torchrun(p, plan, steps, timeout_s, master_addr, as_json)
            return
        if not as_json:
            console.print(f"running {p.strategy} plan of {p.model.name} for {steps} steps …")
        result = api.run(p, steps=steps, emulated=emulated, timeout_s=timeout_s,
                         shape_links=False if no_shaping else None, pin_cores=pin_cores, out_dir=logs,
                         profile=profile)
        if out:
            write_json(str(out), result)
        if as_json:
            print_json(result)
            return
        print_table(f"{p.strategy} on {result['cluster']}: median step of {result['measured_steps']}",
                    ["rank", "device", "slow", "step", "compute", "paced", "wait", "sync"],
                    _rank_rows(result["per_rank"]))
        pred = result["predicted_iteration_time_s"]
        err = result["relative_error"]
        console.print(f"measured iteration time  {human_time(result['measured_iteration_time_s'])}")
        console.print(f"predicted iteration time {human_time(pred)}  ({result['prediction_source']})"
                      + (f", error {err:+.1%}" if err is not None else ""))
        shaping = result["link_shaping"]
        console.print("links: " + ("shaped with netns + tc TBF" if shaping.get("enabled")
                                   else f"not shaped ({shaping.get('reason', 'single node or disabled')})"))
        for n in result["notes"]:
            console.print(f"note: {n}")

    @app.command("demo")
    def demo_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        steps: int = typer.Option(8, "--steps", help="Training steps per strategy (first is warm-up)."),
        budget_s: float = typer.Option(5.0, "--budget-s", help="Planner time budget."),
        no_profile: bool = typer.Option(False, "--no-profile",
                                        help="Predict with the analytic model only (no measured profile)."),
    ) -> None:
        """Plan a zoo model on an emulated 3-device cluster, run it and even DP, compare."""
        from heterog.execute.demo import demo

        say = (lambda s: None) if as_json else (lambda s: console.print(f"[dim]{s}[/dim]"))
        result = demo(steps=steps, budget_s=budget_s, profile=not no_profile, say=say)
        if as_json:
            print_json(result)
            return
        print_table(f"candidates for {result['model']} {result['model_args']} batch {result['batch_size']} "
                    f"on {result['cluster']}", ["strategy", "predicted iteration", "feasible", "devices",
                                                "micro-batches"],
                    [[c["strategy"], human_time(c["iteration_time_s"]), "yes" if c["feasible"] else "no",
                      c["devices_used"], c["num_microbatches"]] for c in result["candidates"]])
        print_table("predicted vs measured", ["strategy", "plan", "predicted", "measured", "error"],
                    [[k, v["strategy"], human_time(v["predicted_iteration_time_s"]),
                      human_time(v["measured_iteration_time_s"]), f"{v['relative_error']:+.1%}"]
                     for k, v in result["strategies"].items()])
        console.print(f"measured speedup of heterog over even data parallelism: "
                      f"{result['measured_speedup']:.2f}× (predicted {result['predicted_speedup']:.2f}×)")
        for n in result["best_plan_notes"]:
            console.print(f"· {n}")


def _print_torchrun(plan, plan_path: Path, steps: int, timeout_s: float, master_addr: str,
                    as_json: bool) -> None:
    """Write the ranks' spec next to the plan and print one torchrun command per node."""
    from heterog.execute.api import plan_cluster, rank_devices
    from heterog.execute.launcher import torchrun_commands
    from heterog.jsonio import write_atomic

    cluster = plan_cluster(plan)
    devices = rank_devices(plan, cluster)
    if cluster is None:
        node_devices = [list(devices)]
    else:
        node_devices = [[d for d in n.devices if d in devices] for n in cluster.nodes]
        node_devices = [n for n in node_devices if n]
    spec_path = plan_path.with_suffix(".torchrun.json")
    write_atomic(spec_path, json.dumps({"torchrun": True, "plan": plan.to_dict(), "node_devices": node_devices,
                                        "steps": steps, "timeout_s": timeout_s, "out_dir": "heterog-run"}))
    cmds = torchrun_commands(spec_path=str(spec_path), node_devices=node_devices, master_addr=master_addr)
    if as_json:
        print_json({"spec": str(spec_path), "commands": cmds})
        return
    console.print(f"ranks' spec written to {spec_path}; copy it to every node, then run:")
    for i, c in enumerate(cmds):
        console.print(f"# node {i} ({', '.join(node_devices[i])})\n{c}")
