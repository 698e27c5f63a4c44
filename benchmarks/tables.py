"""The benchmarks' tables, generated from benchmarks/results/*.json so that no figure is copied by hand.

Writes docs/benchmarks.md (every benchmark: what it measures, the command, its tables) and
rewrites the blocks between `<!-- table:NAME -->` and `<!-- /table:NAME -->` in README.md and
docs/scenarios.md. tests/test_docs.py runs `--check`, which fails when a page is not what the
result files say.

    python benchmarks/tables.py           # rewrite the pages
    python benchmarks/tables.py --check   # exit 1, naming the stale pages, if any
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


# -- formatting ------------------------------------------------------------------------------


def secs(t: float | None) -> str:
    if t is None:
        return "—"
    if t >= 1:
        return f"{t:.2f} s"
    if t < 0.01:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e3:.1f} ms" if t < 0.1 else f"{t * 1e3:.0f} ms"


def pct(x: float | None, signed: bool = False) -> str:
    return "—" if x is None else (f"{x * 100:+.1f} %" if signed else f"{x * 100:.1f} %")


def times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def command_of(doc: dict[str, Any], script: str) -> str:
    """The command that wrote `doc`, as a user types it in the repository: annotations in
    parentheses, `--out PATH` and interpreter paths dropped (they say where one run wrote, not
    what it measured); several commands joined by '+' become '; '."""
    raw = str(doc.get("command") or doc.get("summary", {}).get("command") or f"python {script}")
    out = []
    for cmd in raw.split(" + "):
        cmd = re.sub(r"\s*\(.*?\)", "", cmd)
        cmd = re.sub(r"\s--out\s+\S+", "", cmd).strip()
        cmd = re.sub(r"^(\S*/)?python\S*\s+", "", cmd)
        cmd = re.sub(r"^\S*?(benchmarks/)", r"\1", cmd)
        out.append("python " + cmd if cmd.startswith("benchmarks/") else cmd)
    return "; ".join(out)


# -- one renderer per benchmark: result document → markdown lines ----------------------------


def demo(doc: dict[str, Any], short: bool) -> list[str]:
    rows = []
    for r in doc["runs"]:
        vb, ve = r["speedup_vs_best_baseline"], r.get("speedup_vs_even_dp")
        rows.append(
            [
                r["run"],
                f"{r['heterog_strategy']}: {secs(r['heterog_predicted_s'])} / {secs(r['heterog_measured_s'])}",
                f"{r['best_baseline']}: {secs(r['best_baseline_measured_s'])}",
                secs(r.get("even_dp_measured_s")),
                f"{times(vb['median'])} ({times(vb['worst'])})",
                f"{times(ve['median'])} ({times(ve['worst'])})" if ve else "—",
            ]
        )
    out = table(
        [
            "run",
            "heterog's plan: predicted / measured",
            "best baseline",
            "even DP",
            "over best baseline: median (worst)",
            "over even DP: median (worst)",
        ],
        rows,
    )
    s = doc["summary"]
    for key, what in (("speedup_vs_best_baseline", "the best baseline"), ("speedup_vs_even_dp", "even DP")):
        if key in s:
            v = s[key]
            out.append(
                f"Over {what}: mean {times(v['mean'])}, runs within {pct(v['low'], True)} / "
                f"{pct(v['high'], True)} of it, worst single repetition {times(v['worst_repetition_min'])}."
            )
    return out


def run_vs_sim(doc: dict[str, Any], short: bool) -> list[str]:
    rows = []
    for s in doc["scenarios"]:
        errors = [abs(p["relative_error"]) for p in s["plans"].values() if p.get("relative_error") is not None]
        vb, ve = s["speedup_vs_best_baseline"], s.get("speedup_vs_even_dp")
        rows.append(
            [
                s["scenario"],
                s["heterog_strategy"],
                f"{times(vb['median'])} / {times(vb['worst'])} ({times(vb['predicted'])}) over {s['best_baseline']}"
                if vb
                else "no baseline fits",
                f"{times(ve['median'])} / {times(ve['worst'])} ({times(ve['predicted'])})" if ve else "—",
                f"{pct(statistics.median(errors))} ({len(errors)})" if errors else "—",
            ]
        )
    out = table(
        [
            "scenario",
            "heterog's plan",
            "vs best baseline: median / worst (predicted)",
            "vs even DP: median / worst (predicted)",
            "median \\|error\\| (plans)",
        ],
        rows,
    )
    out.append(
        f"Median |predicted − measured| over all {doc['plans_measured']} plans: "
        f"{pct(doc['median_abs_relative_error'])}; {doc['repetitions']} repetitions of {doc['steps']} "
        f'steps each, interleaved. Even DP is "—" where it does not fit a device\'s memory.'
    )
    if not short:
        out += [""] + run_vs_sim_plans(doc)
    return out


def run_vs_sim_plans(doc: dict[str, Any]) -> list[str]:
    out = []
    for s in doc["scenarios"]:
        rows = [
            [
                name,
                secs(p["predicted_iteration_time_s"]),
                secs(p["measured_iteration_time_s"]),
                pct(p["relative_error"], True),
                pct(p.get("spread")),
            ]
            for name, p in s["plans"].items()
        ]
        out += [f"**{s['scenario']}** — every distinct feasible candidate:", ""]
        out += table(["plan", "predicted", "measured (median)", "error", "spread of repetitions"], rows)
    return out


def plan_quality(doc: dict[str, Any], short: bool) -> list[str]:
    rows = doc["rows"]
    if short:
        by_cluster: dict[str, list[dict]] = {}
        for r in rows:
            by_cluster.setdefault(r["cluster"], []).append(r)
        out = table(
            [
                "cluster",
                "cases",
                "fits where even DP does not",
                "speedup over even DP: median (max)",
                "over the best baseline: median (max)",
            ],
            [
                [
                    c,
                    len(rs),
                    sum(1 for r in rs if r.get("speedup_vs_even_dp") is None and r["feasible"]),
                    _med_max([r.get("speedup_vs_even_dp") for r in rs]),
                    _med_max([r.get("speedup_vs_best_baseline") for r in rs]),
                ]
                for c, rs in by_cluster.items()
            ],
        )
    else:
        bound = any(r.get("above_bound") is not None for r in rows)  # results that recorded the bound
        out = table(
            ["model", "batch", "cluster", "best", "best time", "over even DP", "over best baseline"]
            + (["above the bound"] if bound else []),
            [
                [
                    r["model"],
                    r["batch_size"],
                    r["cluster"],
                    r.get("best") or "no plan fits",
                    secs(r.get("best_time_s")),
                    times(r.get("speedup_vs_even_dp")),
                    times(r.get("speedup_vs_best_baseline")),
                ]
                + ([pct(r.get("above_bound"))] if bound else [])
                for r in rows
            ],
        )
    s = doc["summary"]
    out.append(
        f"{s['cases']} cases; the best plan is never worse than a baseline: "
        f"{'yes' if s['best_never_worse_than_baselines'] else 'no'}; the GNN alone beats the best baseline "
        f"in {s['gnn_alone_beats_best_baseline']}, GNN + search beats search alone in "
        f"{s['gnn_plus_search_beats_search']}."
    )
    if s.get("lm_geomean_gain_over_best_baseline"):
        out[-1] += (
            f" On the {s['lm_cases']} language-model cases (AdamW, fp16/bf16) heterog's plan is "
            f"{times(s['lm_geomean_gain_over_best_baseline'])} faster than the best baseline (geometric mean; "
            f"megatron-3d, the best uniform tp × pp × dp plan, among them)."
        )
    return out


def plan_quality_lm(doc: dict[str, Any], short: bool) -> list[str]:
    """The language models trained with AdamW: heterog's plan against the sharded baselines,
    megatron-3d (the planner's, and the whole grid scored outside the budget) and the best
    baseline (the cases the planner finds nothing for are left out)."""
    rows = [r for r in doc["rows"] if r.get("optimizer") == "adamw" and r.get("feasible")]
    if not rows:
        return ["(no language-model cases in the results: `python benchmarks/plan_quality.py --only lm`)", ""]

    def of(r: dict, k: str) -> float | None:
        return r["times_s"].get(k)

    def full_grid(r: dict) -> str:
        g = r.get("megatron_3d_full_grid")
        if not g:
            return "—"
        if g.get("best_time_s") is None:
            return f"none of {g['configurations']} fits"
        return "{} (tp {}, pp {}, dp {}, {} mb)".format(secs(g["best_time_s"]), *g["tp_pp_dp_microbatches"])

    out = table(
        [
            "model",
            "cluster",
            "precision",
            "heterog's plan",
            "sharded groups",
            "tensor-parallel groups",
            "fsdp-even",
            "zero-uneven",
            "megatron-3d",
            "megatron-3d, whole grid",
            "best baseline",
            "over the best baseline",
            "over fsdp-even",
        ],
        [
            [
                r["model"],
                r["cluster"],
                r["precision"],
                f"{r['best']}, {secs(r['best_time_s'])}",
                r.get("sharded_groups", 0),
                r.get("tensor_parallel_groups", 0),
                secs(of(r, "fsdp-even")),
                secs(of(r, "zero-uneven")),
                secs(of(r, "megatron-3d")),
                full_grid(r),
                r.get("best_baseline") or "—",
                times(r.get("speedup_vs_best_baseline")),
                times(of(r, "fsdp-even") / r["best_time_s"]) if of(r, "fsdp-even") else "does not fit",
            ]
            for r in rows
        ],
    )
    missing = [
        f"{r['model']} on {r['cluster']}"
        for r in doc["rows"]
        if r.get("optimizer") == "adamw" and not r.get("feasible")
    ]
    if missing:
        out += [f"No plan fits {', '.join(missing)}.", ""]
    summary = doc.get("summary", {})
    if summary.get("lm_geomean_gain_over_best_baseline"):
        out += [
            f"Geometric-mean gain of heterog's plan over the best baseline (megatron-3d among them): "
            f"{times(summary['lm_geomean_gain_over_best_baseline'])}; over Megatron's whole uniform grid: "
            f"{times(summary.get('lm_geomean_gain_over_megatron_3d_full_grid'))}, never slower than it: "
            f"{'yes' if summary.get('lm_never_worse_than_megatron_3d_full_grid') else 'no'}.",
            "",
        ]
    return out


REQUIRED_STAGES = ("graph", "cluster_and_costs", "cut_analysis", "grouping", "baselines", "bound")


def _past_allowance_s(r: dict[str, Any]) -> float:
    """How long a run went on past its budget, or past the stages every plan needs when those
    alone took longer."""
    required = sum(r["time_s"].get(k, 0.0) for k in REQUIRED_STAGES)
    return r["wall_s"] - max(r["budget_s"], required)


def search_scale(doc: dict[str, Any], short: bool) -> list[str]:
    rows = [r for r in doc["rows"] if r["feasible"]]
    budgets = sorted({r["budget_s"] for r in rows})
    cases: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["devices"], r["model"]), []).append(r)
    out_rows = []
    for (devices, model), rs in sorted(cases.items()):
        cells = []
        for b in budgets:
            v = [r["best_time_s"] for r in rs if r["budget_s"] == b]
            cells.append(secs(statistics.median(v)) if v else "—")
        base = [r["best_baseline_s"] for r in rs if r["best_baseline_s"] is not None]
        best = min(r["best_time_s"] for r in rs)
        bound = max(r["bound_s"] for r in rs)  # every run's holds; a small budget stops its bisection early
        past = max(r["wall_s"] - r["budget_s"] for r in rs)
        out_rows.append(
            [
                devices,
                model,
                rs[0]["batch_size"],
                secs(statistics.median(base)) if base else "—",
                *cells,
                f"{secs(bound)} ({best / bound:.1f}×)",
                f"{past:+.1f} s / {max(_past_allowance_s(r) for r in rs):+.1f} s",
            ]
        )
    header = ["devices", "model", "batch", "best baseline", *[f"{b:g} s" for b in budgets]]
    out = table([*header, "bound (best ÷ bound)", "past the budget / past the allowance, max"], out_rows)
    s = doc["summary"]
    worse = s["larger_budget_worse"]
    at_1024 = ", ".join(f"{m} {pct(x)}" for m, x in sorted(s["at_1024_15s_above_best_median"].items())) or "—"
    at_4096 = s["at_4096_beats_every_baseline"]
    seeds = ", ".join(str(x) for x in sorted({r["seed"] for r in rows}))
    load = s["load_average"][0]
    out.append(
        f"Best plan's simulated iteration time, median over seeds {seeds}, by budget ({s['runs']} runs, "
        f"{doc.get('cores', '?')} cores, load average {load:.1f} at the end). "
        f"A larger budget with the same seed gave a worse plan: {len(worse)} times. "
        f"At 1024 devices the 15-s plan is slower than the best plan of any budget by (median over seeds): {at_1024}. "
        f"At 4096 devices the best plan beats every baseline: "
        f"{sum(at_4096.values())} of {len(at_4096)} runs. The allowance is the budget, or the stages every plan "
        f"needs (graph, costs, baselines, bound) when they alone take longer."
    )
    return out


def bound_tightness(doc: dict[str, Any], short: bool) -> list[str]:
    rows = doc["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    plans = {r["model"]: r for r in rows if "best_s" in r}
    out = table(
        [
            "model",
            "batch",
            *[f"bound ({x})" for x in labels],
            "best plan",
            "above the bound",
            "data parallelism's compute",
            "… in whole samples",
            "… with one optimizer step",
        ],
        [
            [
                m,
                plans[m]["batch_size"],
                *[secs(next(r["bound_s"] for r in rows if r["model"] == m and r["label"] == x)) for x in labels],
                f"{secs(p['best_s'])} ({p['best']})",
                " → ".join(
                    pct(p["best_s"] / r["bound_s"] - 1)
                    for x in labels
                    for r in rows
                    if r["model"] == m and r["label"] == x
                ),
                f"{secs(p['dp_compute_s'])} (the plan {pct(p['above_dp_compute'])} above)",
                f"{secs(p['dp_whole_samples_s'])} (the plan {pct(p['above_dp_whole_samples'], True)})"
                if "dp_whole_samples_s" in p
                else "—",
                secs(p["dp_one_step_s"]) if "dp_one_step_s" in p else "—",
            ]
            for m, p in plans.items()
        ],
    )
    out.append(
        "The lower bound printed beside every plan, and the best plan of a 6-s search (seed 0), on paper-8gpu. "
        "Data parallelism's compute: the least time any data-parallel plan spends computing (shares continuous, "
        "communication free) — a plan near it is near what data parallelism can do, and the rest of the gap is "
        "the bound's; in whole samples: each device a whole number of samples and every replica its whole "
        "optimizer step (the plan's time against it: below zero, the plan beats data parallelism); with one "
        "optimizer step: continuous shares, and the optimizer stepped once in all, a part on each device, as the "
        "bound allows (sharded state with free collectives) — between it and the bound lies what splitting the "
        "groups over the devices would gain. Bounds: "
        + "; ".join(f"{k}, {v}" for k, v in doc.get("labels", {}).items())
        + f". Load average {doc['summary']['load_average'][0]:.1f} at the end."
    )
    return out


def _med_max(values: list[float | None]) -> str:
    v = [x for x in values if x is not None]
    return f"{times(statistics.median(v))} ({times(max(v))})" if v else "—"


def _overall(by_type: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(how many GPU types, the figures over all of them) of a per-type summary, keyed either
    'TYPE' and 'all' or 'TYPE/PRECISION', 'TYPE/all' and 'all/all'."""
    if "all/all" in by_type:
        return sum(1 for k in by_type if k.endswith("/all") and k != "all/all"), by_type["all/all"]
    if "all" in by_type:
        return len(by_type) - 1, by_type["all"]
    return None


def predict_gpu(doc: dict[str, Any], short: bool) -> list[str]:
    s = doc["summary"]
    if short:  # one row per check: the held-out H200 steps, then each kind of per-type figure
        rows = []
        if "h200" in s and "all" in s["h200"]:
            a = s["h200"]["all"]
            rows.append(
                [
                    "H200 step time, each model held out",
                    a["cases"],
                    pct(a["median_time_error"]),
                    pct(a["worst_time_error"]),
                ]
            )
            rows.append(["H200 peak memory, each model held out", a["cases"], pct(a["median_memory_error"]), "—"])
        for key, what in (
            ("per_type", "per-layer time, layers held out within each GPU type"),
            ("leave_one_type_out", "per-layer time, each GPU type held out"),
        ):
            overall = _overall(s.get(key, {}))
            if overall:
                types, a = overall
                rows.append(
                    [
                        f"{what} ({types} types)",
                        a.get("layers", a.get("cases", "—")),
                        pct(a.get("median_abs_error", a.get("median_error"))),
                        pct(a.get("worst_error")),
                    ]
                )
        return table(["prediction", "cases", "median error", "worst"], rows)
    out = []
    if "h200" in s:
        out += ["H200 training steps, each model predicted with figures fitted on the others:", ""]
        out += table(
            ["model", "steps", "median time error", "worst", "median memory error", "memory under-predicted > 10 %"],
            [
                [
                    m.replace("_", "-"),
                    v["cases"],
                    pct(v["median_time_error"]),
                    pct(v["worst_time_error"]),
                    pct(v["median_memory_error"]),
                    v["memory_under_10pct"],
                ]
                for m, v in s["h200"].items()
            ],
        )
    for key, what in (
        ("per_type", "Per-layer times per GPU type, layers held out within each type:"),
        ("leave_one_type_out", "Each GPU type predicted with figures fitted on the other types:"),
    ):
        if key in s:
            out += [what, ""]
            out += table(
                ["GPU type", "layers", "median error", "worst"],
                [
                    [
                        t.removesuffix("/all"),
                        v.get("layers", v.get("cases", "—")),
                        pct(v.get("median_abs_error", v.get("median_error"))),
                        pct(v.get("worst_error")),
                    ]
                    for t, v in s[key].items()
                    if "/" not in t or t.endswith("/all")
                ],
            )
    return out


def _pcie_calibration(cal: dict[str, Any] | None) -> list[str]:
    """What the T4 PCIe calibration (cost/pcie.py) is, and its in-sample and held-out errors."""
    if not cal:
        return ["Nothing is calibrated on these runs: the T4's PCIe ports run at the catalog's rate.", ""]
    cv = cal["cross_validation"]
    held = "; ".join(f"{k}: {pct(v['median_abs_error'])}" for k, v in cv.items())
    return [
        f"The T4's PCIe port as NCCL reaches it ({cal['bandwidth_gbytes_per_s']:.1f} GB/s per direction, "
        f"{cal['latency_us']:.0f} µs per transfer; heterog/cost/data/pcie_links.json) is fitted on these runs: "
        f"median |error| {pct(cal['in_sample']['median_abs_error'])} in-sample, "
        f"{pct(max(v['median_abs_error'] for v in cv.values()))} at worst held out by configuration family "
        f"(median |error| of each run predicted by the fit without its family — {held}).",
        "",
    ]


def _held_out_table(cal: dict[str, Any] | None) -> list[str]:
    """Per cross-validation family: the held-out error and what each fold's fit chose."""
    if not cal:
        return []
    in_sample = cal["in_sample"]
    rows = [
        [
            "in-sample (fitted on all)",
            in_sample["runs"],
            pct(in_sample["median_abs_error"]),
            "—",
            f"{cal['bandwidth_gbytes_per_s']:.1f} GB/s, {cal['latency_us']:.0f} µs",
        ]
    ]
    for name, v in cal["cross_validation"].items():
        chosen = "; ".join(
            f"{k}: {f['bandwidth_gbytes_per_s']:.1f} GB/s, {f['latency_us']:.0f} µs" for k, f in v["fits"].items()
        )
        rows.append([name, v["runs"], pct(v["median_abs_error"]), pct(v["worst_abs_error"]), chosen])
    return table(["T4 PCIe calibration scored", "runs", "median error", "worst", "fitted figures"], rows)


def amp_iterations(doc: dict[str, Any], short: bool) -> list[str]:
    s = doc["summary"]
    rows = doc["rows"]

    def errs(family: dict[str, Any], key: str | None = None) -> str:
        e = family[key] if key else family
        return f"{pct(e.get('median_abs_error'))} ({pct(e.get('worst_abs_error'))})"

    families = [("tp = 1 (dp × pp)", s["tp1"]), ("tp = 2, 4 (tp × dp × pp)", s["tp_gt1"]), ("all", s["all"])]
    if short:
        return table(
            ["GPT-2 345M on 16 T4s (DeepSpeed)", "configurations", "heterog: median (worst) error", "AMP's own model"],
            [[name, f["configurations"], errs(f, "one_reduce"), errs(f, "amp")] for name, f in families],
        ) + _pcie_calibration(s.get("calibration"))

    def err(r: dict[str, Any], key: str) -> str:
        return "—" if r["measured_s"] is None else pct(r[key] / r["measured_s"] - 1, signed=True)

    out = table(
        [
            "tp",
            "dp",
            "pp",
            "micro-batch",
            "micro-batches",
            "measured",
            "as DeepSpeed runs it",
            "error",
            "heterog's own schedule",
            "error",
            "AMP's model",
            "error",
            "fits",
        ],
        [
            [
                r["tp"],
                r["dp"],
                r["pp"],
                r["micro_batch"],
                r["microbatches"],
                "failed" if r["measured_s"] is None else secs(r["measured_s"]),
                secs(r["predicted_one_reduce_s"]),
                err(r, "predicted_one_reduce_s"),
                secs(r["predicted_s"]),
                err(r, "predicted_s"),
                secs(r["amp_predicted_s"]),
                err(r, "amp_predicted_s"),
                f"{'yes' if r['fits'] else 'no'} ({r['peak_memory_gib']:.1f} GiB)",
            ]
            for r in rows
        ],
    )
    out += [""]
    out += table(
        [
            "measured runs",
            "configurations",
            "as DeepSpeed runs it: median (worst) error",
            "heterog's own schedule",
            "AMP's model",
        ],
        [[name, f["configurations"], errs(f, "one_reduce"), errs(f, None), errs(f, "amp")] for name, f in families],
    )
    out += _pcie_calibration(s.get("calibration"))
    out += _held_out_table(s.get("calibration"))
    out.append(
        f"Runs that failed (out of memory or an error): {s['failed_runs']}, "
        f"{s['failed_runs_predicted_not_to_fit']} of them predicted not to fit; runs predicted not to fit that "
        f"ran: {s['ran_but_predicted_not_to_fit']}."
    )
    return out


def predict_accuracy(doc: dict[str, Any], short: bool) -> list[str]:
    s = doc["summary"]
    out = table(
        ["configuration", "measured step", "predicted", "time error", "memory error"],
        [
            [
                c["label"],
                secs(statistics.median(c["measured"]["step_times_s"])),
                secs(c["predicted"]["iteration_time_s"]),
                pct(c["time_error_pct"] / 100),
                pct(c["memory_error_pct"] / 100),
            ]
            for c in doc["configs"]
        ],
    )
    out.append(
        f"Median time error {pct(s['time_error_pct']['median'] / 100)} (worst "
        f"{pct(s['time_error_pct']['worst'] / 100)}), memory {pct(s['memory_error_pct']['median'] / 100)} "
        f"(worst {pct(s['memory_error_pct']['worst'] / 100)}); {s['device']}, {s['threads']} thread(s), "
        f"{s['precision']}."
    )
    return out


def simulator_speed(doc: dict[str, Any], short: bool) -> list[str]:
    return table(
        ["cluster", "devices", "plan", "tasks", "plans/s", "neighbours/s"],
        [
            [
                r["cluster"],
                r["devices"],
                r["plan"],
                r["tasks"],
                f"{r['plan_sims_per_s']:.0f}",
                f"{r['warm_sims_per_s']:.1f}" if r["warm_sims_per_s"] < 100 else f"{r['warm_sims_per_s']:.0f}",
            ]
            for r in doc["rows"]
        ],
    )


def capture(doc: dict[str, Any], short: bool) -> list[str]:
    rows = doc["results"]
    if short:
        rows = [r for r in rows if r["name"] in ("resnet50", "bert-large", "gpt2-xl", "llama-7b")]
    return table(
        ["model", "parameters", "nodes", "capture time", "peak RSS"],
        [
            [r["name"], f"{r['num_parameters']:,}", r["num_nodes"], secs(r["capture_time_s"]), mib(r["peak_rss_bytes"])]
            for r in rows
        ],
    )


def command_times(doc: dict[str, Any], short: bool) -> list[str]:
    out = table(
        ["command", "what", "cold", "warm"],
        [
            [
                f"`{r['command']}`",
                r["what"],
                secs(r.get("cold_s")),
                secs(r["warm_s"]) + (f" (search {secs(r['search_s'])})" if "search_s" in r else ""),
            ]
            for r in doc["rows"]
        ],
    )
    out.append(
        f"Wall-clock medians of {doc['repeats']} runs each on a {doc['cpu_count']}-core machine "
        f"(load average {doc['load_average_before'][0]:.1f} at the start); cold: an empty cache folder."
    )
    return out


def report_size(doc: dict[str, Any], short: bool) -> list[str]:
    return table(
        ["model", "cluster", "devices", "page size", "load", "simulate", "render"],
        [
            [
                r["model"],
                r["cluster"],
                r["devices"],
                f"{r['bytes'] / 2**10:.0f} KiB",
                secs(r.get("load_s")),
                secs(r["simulate_s"]),
                secs(r["render_s"]),
            ]
            for r in doc["cases"]
        ],
    )


def one_prediction(doc: dict[str, Any], short: bool) -> list[str]:
    """One row per command, one column per plan; `heterog run` rows merged whatever its flags."""
    cases = doc["cases"]

    def key(cmd: str) -> str:
        return "heterog run plan.json" if cmd.startswith("heterog run ") else cmd

    commands = list(dict.fromkeys(key(c) for case in cases for c in case["predicted_s"]))
    by_case = [{key(c): t for c, t in case["predicted_s"].items()} for case in cases]
    header = ["command", *(f"{c['model']} on {c['cluster']} ({c['strategy']})" for c in cases)]
    out = table(
        header, [[f"`{cmd}`", *(f"{t[cmd] * 1e3:.6g} ms" if cmd in t else "—" for t in by_case)] for cmd in commands]
    )
    same = all(c["all_equal"] for c in cases)
    out.append(
        (
            "Each plan got one predicted time from every command"
            if same
            else "The commands did not all print the same predicted time"
        )
        + " (each in its own process; a GPU cluster's plan runs here with `--emulated`)."
    )
    return out


def allreduce_under_compute(doc: dict[str, Any], short: bool) -> list[str]:
    out = table(
        ["ranks paced", "idle ranks (median)", "ranks computing (median)", "slower by"],
        [
            [f"{k}×", secs(v["median_idle_s"]), secs(v["median_loaded_s"]), times(v["loaded_over_idle"])]
            for k, v in doc["by_slowdown"].items()
        ],
    )
    out.append(f"{doc['bytes'] / 1e6:.1f} MB, {doc['rounds']} rounds per case.")
    return out


def launch_order_ab(doc: dict[str, Any], short: bool) -> list[str]:
    out = table(
        ["order", "predicted", "measured (median)", "error"],
        [
            [
                k,
                secs(v["predicted_iteration_time_s"]),
                secs(v["measured_iteration_time_s"]),
                pct(v["relative_error"], True),
            ]
            for k, v in doc["runs"].items()
        ],
    )
    out.append(
        f"Old order over new: {times(doc['old_over_new'])} ({doc['scenario']}, heterog's "
        f"{doc['heterog_strategy']} plan)."
    )
    return out


def simulator_priorities(doc: dict[str, Any], short: bool) -> list[str]:
    return table(
        [
            "model",
            "plans",
            "heteroG order vs graph order",
            "upward rank vs graph order",
            "upward no slower than heteroG",
        ],
        [
            [
                r["model"],
                r["plans"],
                times(r["heteroG_vs_graph_order"]),
                times(r["upward_vs_graph_order"]),
                pct(r["upward_no_slower_than_heteroG"]),
            ]
            for r in doc["rows"]
        ],
    )


def split_export(doc: dict[str, Any], short: bool) -> list[str]:
    return table(
        ["model", "nodes", "stages", "split time", "tied parameters", "stage parameters are the model's"],
        [
            [
                r["model"],
                r["nodes"],
                r["stages"],
                secs(r["split_s"]),
                ", ".join(r["tied"]) or "—",
                "yes" if r["stage_params_are_the_models"] else "no",
            ]
            for r in doc["rows"]
        ],
    )


def resume_after_fault(doc: dict[str, Any], short: bool) -> list[str]:
    rows = [["uninterrupted", "—", secs(doc["uninterrupted_wall_s"]), "—"]]
    rows += [
        [k.replace("_", " "), ", ".join(v["devices"]), secs(v["wall_s"]), f"{v['max_relative_difference']:.2g}"]
        for k, v in doc["resumed"].items()
    ]
    out = table(["run", "devices", "wall time", "largest relative parameter difference"], rows)
    out.append(f"{doc['scenario']}.")
    return out


def elastic(doc: dict[str, Any], short: bool) -> list[str]:
    out: list[str] = []
    if "recovery" in doc:
        rec = doc["recovery"]
        out += table(
            ["re-plan", "devices before → after", "resumed after step", "search", "loss to next step"],
            [
                [
                    r["reason"],
                    " → ".join(", ".join(d) for d in r["devices"]),
                    r["resumed_after_step"],
                    secs(r["replan_s"]),
                    secs(r["recovery_s"]),
                ]
                for r in rec["replans"]
            ],
        )
        out.append(f"{rec['scenario']}; the whole run {secs(rec['wall_s'])}.")
        out.append("")
    if "replan" in doc:
        q = doc["replan"]
        rows = [
            [name, secs(q[key]["wall_s"]), q[key]["devices"], secs(q[key]["predicted_s"])]
            for name, key in (
                ("warm start, 3-s budget", "warm_3s"),
                ("cold, 3 s", "cold_3s"),
                ("cold, 60 s", "cold_60s"),
            )
        ]
        out += table(["re-plan", "wall time", "devices used", "predicted iteration"], rows)
        out.append(
            f"{q['scenario']} ({', '.join(q['removed'])}). Warm start vs the cold 60-s search: "
            f"{pct(q['warm_vs_cold_60s'], signed=True)}; cold 3 s vs cold 60 s: "
            f"{pct(q['cold_3s_vs_cold_60s'], signed=True)}."
        )
    out.append(f"Measured on {doc.get('machine', 'this machine')}.")
    return out


def run_many_vs_run(doc: dict[str, Any], short: bool) -> list[str]:
    return table(
        ["family", "plans", "one launch per plan", "one launch (run_many)", "speedup"],
        [
            [r["family"], r["distinct_plans"], secs(r["run_each_s"]), secs(r["run_many_s"]), times(r["speedup"])]
            for r in doc["rows"]
        ],
    )


def plan_cost(doc: dict[str, Any], short: bool) -> list[str]:
    rows = []
    for r in doc["rows"]:
        f, c = r["fastest"], r["cheapest"]
        shape = f"{r['batch_size']}" + (f" × {r['seq_len']}" if r["seq_len"] else "")
        rows.append(
            [
                f"{r['model']} ({shape})",
                r["cluster"],
                f"{f['strategy']} on {f['devices_used']}",
                secs(f["iteration_time_s"]),
                f"${f['usd_per_million_samples']:.2f}",
                f"{c['strategy']} on {c['devices_used']}",
                secs(c["iteration_time_s"]),
                f"${c['usd_per_million_samples']:.2f}",
                times(r["time_ratio"]),
                times(r["cost_ratio"]),
            ]
        )
    out = table(
        ["model (batch)", "cluster", "fastest", "time", "$/M samples", "cheapest", "time", "$/M samples",
         "cheapest is slower", "fastest costs more"],
        rows,
    )  # fmt: skip
    assumed = {k: v for r in doc["rows"] for k, v in r["assumed_usd_per_hour"].items()}
    if assumed and not short:
        out += [
            "Types without a catalog price, priced here at the median catalog price per peak fp32 TFLOP/s "
            f"(${doc['usd_per_fp32_tflops']:.4f}): " + ", ".join(f"{k} ${v:.2f}/h" for k, v in assumed.items()) + ".",
        ]
    return out


def gpu_check(doc: dict[str, Any], short: bool) -> list[str]:
    sec = doc["sections"]
    env, tests, check, shared, steps = (sec[k] for k in ("env", "tests", "check", "shared", "steps"))
    after = tests.get("after_fix", {}).get("summary", "")
    checks = sum(r["ok"] for r in check["rows"])
    worst = max(r["max_relative_difference"] for r in shared["rows"])
    by = {p: [r for r in steps["rows"] if r["precision"] == p] for p in ("fp32", "amp-bf16")}

    def med(rows: list[dict], key: str) -> str:
        return pct(statistics.median(abs(r[key]) if key != "overhead" else r[key] for r in rows), key == "overhead")

    def memory(rows: list[dict]) -> str:  # a run whose peaks held other cases' models says so
        return "not comparable (see below)" if "memory_note" in steps else med(rows, "memory_prediction_error")

    out = table(
        ["what ran on " + env["gpu_name"], "result"],
        [
            ["gpu-marked tests", tests["summary"] + (f"; the failed ones after the fix: {after}" if after else "")],
            ["`heterog check --device cuda`, 6 families × pipeline / hybrid", f"{checks} of {len(check['rows'])} ok"],
            ["ranks sharing the GPU (gloo): " + ", ".join(r["plan"] for r in shared["rows"]),
             f"parameters after 3 steps within {worst:.1e} of single-process training"],
            *[[f"training steps, {p} ({len(rows)} cases): heterog's executor over a plain loop; prediction's error on "
               "step time, peak memory", f"{med(rows, 'overhead')}; {med(rows, 'step_prediction_error')}, "
               f"{memory(rows)} (medians)"] for p, rows in by.items() if rows],
        ],
    )  # fmt: skip
    if "memory_note" in steps and short:
        out.append("Peak memory: this run's peaks include earlier cases' models, kept on the GPU by its cache.")
    elif "memory_note" in steps:
        out.append(f"Peak memory in this run: {steps['memory_note']}")
    if short:
        return out
    out += table(
        ["model", "batch", "precision", "plain loop", "heterog", "overhead", "predicted", "error", "peak",
         "predicted peak", "error"],
        [
            [r["model"], r["batch_size"], r["precision"], secs(r["plain_step_s"]), secs(r["heterog_step_s"]),
             pct(r["overhead"], True), secs(r["predicted_step_s"]), pct(r["step_prediction_error"], True),
             mib(r["plain_peak_bytes"]), mib(r["predicted_peak_bytes"]), pct(r["memory_prediction_error"], True)]
            for r in steps["rows"]
        ],
    )  # fmt: skip
    skipped = [*check.get("skipped", []), *shared.get("skipped", []), *steps.get("skipped", [])]
    notes = [f"{env['gpu_name']}, torch {env['torch']}, CUDA {env['cuda']}."]
    if "before_fix" in check:
        b = check["before_fix"]
        notes.append(f"Before the fix ({b['fix']}) the checks of {', '.join(b['failed'])} failed: {b['problem']}.")
    if skipped:
        notes.append(f"Past the run's deadline, not measured: {', '.join(skipped)}.")
    return out + [" ".join(notes)]


@dataclass(frozen=True, kw_only=True)
class Section:
    key: str
    title: str
    script: str
    result: str
    about: str
    render: Callable[[dict[str, Any], bool], list[str]]


SECTIONS = (
    Section(
        key="demo",
        title="The demo, five times in a row",
        script="benchmarks/demo_repeat.py",
        result="demo_five_runs.json",
        render=demo,
        about="`heterog demo` (cnn-slow-link, docs/scenarios.md) run five times: heterog's plan, the best "
        "baseline and even data parallelism, interleaved in one launch of the ranks.",
    ),
    Section(
        key="run-vs-sim",
        title="Predicted vs measured on emulated clusters",
        script="benchmarks/run_vs_sim.py",
        result="run_vs_sim.json",
        render=run_vs_sim,
        about="Every distinct feasible candidate of each scenario of docs/scenarios.md runs on real processes; "
        "the best baseline is the fastest measured one.",
    ),
    Section(
        key="one-prediction",
        title="One prediction per plan",
        script="benchmarks/one_prediction.py",
        result="one_prediction.json",
        render=one_prediction,
        about="The predicted iteration time each command prints for one saved plan, each command in its own process.",
    ),
    Section(
        key="plan-quality",
        title="Plan quality",
        script="benchmarks/plan_quality.py",
        result="plan_quality.json",
        render=plan_quality,
        about="The paper's models and more on the built-in GPU clusters; every candidate's simulated iteration time.",
    ),
    Section(
        key="plan-quality-lm",
        title="Plan quality: language models with sharded state",
        script="benchmarks/plan_quality.py",
        result="plan_quality.json",
        render=plan_quality_lm,
        about="gpt2-xl, tinyllama-1.1b and llama-7b trained with AdamW (batch 16) on the built-in GPU clusters, "
        "against the sharded baselines fsdp-even (ZeRO-3, even) and zero-uneven (Cephalo's rule) and megatron-3d "
        "(the best uniform tp × pp × dp plan: the planner's within its budget, and the whole grid); simulated.",
    ),
    Section(
        key="plan-cost",
        title="Cheapest plan per sample against the fastest",
        script="benchmarks/plan_cost.py",
        result="plan_cost.json",
        render=plan_cost,
        about="`--objective cost` and `--objective time` (tolerance 0, same seed and move cap) for a CNN and a "
        "transformer; prices: the catalog's list prices, and an assumed price for each unpriced type.",
    ),
    Section(
        key="search-scale",
        title="Search at scale",
        script="benchmarks/search_scale.py",
        result="search_scale.json",
        render=search_scale,
        about="`heterog plan` as a whole (graph from the cache, costs, baselines, bound, search) on 16 to 4096 "
        "GPUs, by budget and seed; the 256- and 4096-GPU clusters are benchmarks/clusters/*.yaml.",
    ),
    Section(
        key="bound-tightness",
        title="How far plans are from the lower bound",
        script="benchmarks/bound_tightness.py",
        result="bound_tightness.json",
        render=bound_tightness,
        about="The lower bound (search/bound.py) on paper-8gpu's CNNs, before and after its chain and per-call "
        "terms, against the best plan and the least compute of data parallelism.",
    ),
    Section(
        key="gpu-check",
        title="One GPU",
        script="benchmarks/gpu_check.py",
        result="gpu_check.json",
        render=gpu_check,
        about="The one script run first on a GPU machine: the gpu-marked tests, `heterog check` on CUDA, plans "
        "whose ranks share the GPU (tensor parallelism among them) against single-process training, and "
        "training steps through heterog's executor beside a plain PyTorch loop and the cost model's prediction.",
    ),
    Section(
        key="prediction-accuracy",
        title="GPU prediction accuracy",
        script="benchmarks/predict_gpu.py",
        result="predict_gpu.json",
        render=predict_gpu,
        about="Predicted against measured GPU training steps and per-layer times (docs/cost_model.md).",
    ),
    Section(
        key="iteration-accuracy",
        title="Whole multi-GPU iterations",
        script="benchmarks/amp_iterations.py",
        result="amp_iterations.json",
        render=amp_iterations,
        about="Public measured iterations of GPT-2 345M on 16 T4s in 4 nodes (AMP's DeepSpeed runs), each "
        "configuration planned on the same devices (a tensor-parallel group as one rank of Megatron's split, "
        "cost/tensor_parallel.py) and simulated; the T4's PCIe figures are fitted on them and cross-validated.",
    ),
    Section(
        key="cpu-accuracy",
        title="CPU prediction accuracy",
        script="benchmarks/predict_accuracy.py",
        result="predict_accuracy.json",
        render=predict_accuracy,
        about="One training step of small zoo models on this machine's CPU, predicted and measured.",
    ),
    Section(
        key="command-times",
        title="How fast commands start",
        script="benchmarks/report_size.py",
        result="command_times.json",
        render=command_times,
        about="Whole commands as a user runs them, each in a fresh process.",
    ),
    Section(
        key="report-size",
        title="Report size and time",
        script="benchmarks/report_size.py",
        result="report_size.json",
        render=report_size,
        about="`heterog report` of planned cases, timed inside one process: load (graph, cluster, costs), "
        "simulate, render.",
    ),
    Section(
        key="simulator-speed",
        title="Simulator speed",
        script="benchmarks/simulator_speed.py",
        result="simulator_speed.json",
        render=simulator_speed,
        about="A 1000-node synthetic graph, 50-group plans, one core; a neighbour is the plan with one "
        "group's shares changed, as the search scores them.",
    ),
    Section(
        key="capture",
        title="Capture",
        script="benchmarks/capture.py",
        result="capture.json",
        render=capture,
        about="Each model captured in a fresh process at its default batch; peak RSS includes the imported "
        "torch and transformers.",
    ),
    Section(
        key="allreduce-under-compute",
        title="All-reduce while ranks compute",
        script="benchmarks/allreduce_under_compute.py",
        result="allreduce_under_compute.json",
        render=allreduce_under_compute,
        about="The executor's ring all-reduce on loopback, on idle ranks and on ranks computing paced.",
    ),
    Section(
        key="launch-order",
        title="Collective launch order",
        script="benchmarks/launch_order_ab.py",
        result="launch_order_ab.json",
        render=launch_order_ab,
        about="One plan run with its gradient syncs launched in two orders, interleaved, beside a "
        "single-device control.",
    ),
    Section(
        key="priorities",
        title="Execution-order priorities",
        script="benchmarks/simulator_priorities.py",
        result="simulator_priorities.json",
        render=simulator_priorities,
        about="Simulated iteration time of random plans under two priority rules, relative to graph order "
        "(below 1: faster).",
    ),
    Section(
        key="split-export",
        title="Cutting models for the executor",
        script="benchmarks/split_export.py",
        result="split_export.json",
        render=split_export,
        about="Each model exported once and cut into stages, as the ranks do before training.",
    ),
    Section(
        key="resume",
        title="Resume after a failed rank",
        script="benchmarks/resume_after_fault.py",
        result="resume_after_fault.json",
        render=resume_after_fault,
        about="A run whose rank is killed, resumed from its last checkpoint with the same plan and with one "
        "device fewer, against an uninterrupted run.",
    ),
    Section(
        key="elastic",
        title="Elastic runs: recovery and the warm-started re-plan",
        script="benchmarks/elastic.py",
        result="elastic.json",
        render=elastic,
        about="A 3-device run that loses a device and gets it back, and a re-plan on mixed-64 after losing "
        "four devices: warm-started with 3 s against cold searches.",
    ),
    Section(
        key="run-many",
        title="Many plans in one launch",
        script="benchmarks/run_many_vs_run.py",
        result="run_many_vs_run.json",
        render=run_many_vs_run,
        about="Every planner candidate of one model run for two steps, one launch per plan against one "
        "launch for all (heterog.run_many).",
    ),
)


def load(section: Section) -> dict[str, Any] | None:
    path = RESULTS / section.result
    return json.loads(path.read_text()) if path.is_file() else None


def section_lines(section: Section, doc: dict[str, Any], *, short: bool, level: str) -> list[str]:
    return [f"{level} {section.title} — `{command_of(doc, section.script)}`", *section.render(doc, short)]


def benchmarks_page() -> str:
    out = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/tables.py` from `benchmarks/results/*.json`; each section names "
        "the command that wrote its file. Figures are from a shared 2-core CPU machine unless a section "
        "says otherwise: compare figures within a table, not across runs.",
        "",
    ]
    for s in SECTIONS:
        doc = load(s)
        if doc is None:
            continue
        out += [f"## {s.title} — `{command_of(doc, s.script)}`", "", s.about, "", *s.render(doc, False)]
        out += ["" if out[-1] else None, f"Results: `benchmarks/results/{s.result}`.", ""]
    return "\n".join(line for line in out if line is not None).rstrip() + "\n"


def scenarios_block() -> list[str]:
    """The scenarios as demo.py defines them, beside run_vs_sim's latest figures."""
    from heterog.demo import SCENARIOS

    runs = {s["scenario"]: s for s in (load(SECTIONS[1]) or {"scenarios": []})["scenarios"]}
    rows = []
    for sc in SCENARIOS.values():
        r = runs.get(sc.name)
        vb = r["speedup_vs_best_baseline"] if r else None
        args = ", ".join(f"{k} {v}" for k, v in sc.model_args.items())
        rows.append(
            [
                sc.name,
                f"{sc.model} ({args})",
                f"{sc.batch_size}" + (f" × {sc.seq_len}" if sc.seq_len else ""),
                " / ".join(f"{x:g}×" for x in sc.slowdowns),
                f"{sc.slow_link_gbps:g} Gb/s",
                f"{sc.memory_gib * 1024:g} MiB on {', '.join(sc.capped_devices)}" if sc.memory_gib else "—",
                (
                    "not run"
                    if not r
                    else f"{r['heterog_strategy']}, no baseline fits"
                    if vb is None
                    else f"{r['heterog_strategy']}, {times(vb['median'])} over {r['best_baseline']}"
                ),
            ]
        )
    return table(
        [
            "scenario",
            "model",
            "batch (× sequence)",
            "slowdowns a/cpu0, a/cpu1, b/cpu0",
            "node b's link",
            "memory cap",
            "latest run: heterog's plan, measured speedup",
        ],
        rows,
    )


def blocks() -> dict[str, list[str]]:
    """Every named block the pages may hold: each benchmark's short form, and the scenarios."""
    out: dict[str, list[str]] = {"scenarios": scenarios_block()}
    for s in SECTIONS:
        doc = load(s)
        if doc is not None:
            out[s.key] = section_lines(s, doc, short=True, level="###")
            out[f"{s.key}-full"] = s.render(doc, False)
    return out


def fill(text: str, named: dict[str, list[str]], where: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(2) not in named:
            raise SystemExit(f"{where}: no table named {m.group(2)!r} (results file missing?)")
        body = "\n".join(named[m.group(2)]).rstrip() + "\n"
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(sub, text)


def pages() -> dict[Path, str]:
    """Every page this script writes: docs/benchmarks.md whole, and the named blocks of README.md
    and of the other docs pages."""
    named = blocks()
    generated = ROOT / "docs" / "benchmarks.md"
    out = {generated: benchmarks_page()}
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        if page != generated:
            out[page] = fill(page.read_text(), named, page.name)
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, text in pages().items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path)
            if "--check" not in argv:
                path.write_text(text)
    if "--check" in argv and stale:
        print("out of date (run python benchmarks/tables.py): " + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    for p in stale:
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
