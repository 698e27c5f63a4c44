"""Why the planner chose what it chose: notes on a Plan, and the infeasible answer."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

import numpy as np

from heterog.cli.output import human_bytes, human_time
from heterog.ir.plan import Plan

if TYPE_CHECKING:
    from heterog.search.planner import Candidate
    from heterog.search.problem import Problem


def _segments(plan: Plan) -> list[tuple[int, int]]:
    out, a = [], 0
    G = plan.groups
    for g in range(1, len(G) + 1):
        if g == len(G) or (G[g].replicas, G[g].sync, G[g].ps_device) != (G[a].replicas, G[a].sync, G[a].ps_device):
            out.append((a, g))
            a = g
    return out


def _kind(prob: "Problem", device: str) -> str:
    """GPU type, with the slowdown of an emulated device (two 'cpu' devices may differ)."""
    d = prob.cluster.device(device)
    return d.gpu_type if d.slowdown == 1.0 else f"{d.gpu_type}/{d.slowdown:g}x-slower"


def notes(prob: "Problem", winner: "Candidate", candidates: Sequence["Candidate"]) -> list[str]:
    plan = winner.plan
    out = [f"chose {winner.strategy!r}: {human_time(winner.iteration_time_s)} per iteration "
           f"({'simulated' if winner.scored_by == 'simulator' else 'estimated'}), using "
           f"{len(plan.devices())} of {prob.n_devices} devices."]
    ref = next((c for c in candidates if c.strategy == "even-dp-allreduce"), None)
    if ref is not None and ref.strategy != winner.strategy:
        if ref.feasible:
            out.append(f"{ref.iteration_time_s / winner.iteration_time_s:.2f}× faster than even data "
                       f"parallelism with ring all-reduce ({human_time(ref.iteration_time_s)}).")
        else:
            worst = max(ref.peak_memory_bytes.items(), key=lambda kv: kv[1] / prob.cluster.memory_bytes(kv[0]),
                        default=None)
            if worst is not None:
                out.append(f"even data parallelism does not fit: it needs {human_bytes(worst[1])} on "
                           f"{worst[0]}, which has {human_bytes(prob.cluster.memory_bytes(worst[0]))}.")
    beaten = [f"{c.strategy} {human_time(c.iteration_time_s) if c.feasible else 'infeasible (memory)'}"
              for c in candidates if c.strategy != winner.strategy]
    if beaten:
        out.append("compared: " + "; ".join(beaten) + ".")
    speed = 1.0 / prob.device_time_per_sample_s
    for a, b in _segments(plan)[:8]:
        g = plan.groups[a]
        span = f"groups g{a}–g{b - 1}" if b - a > 1 else f"group g{a}"
        if len(g.replicas) == 1:
            out.append(f"{span}: on {g.replicas[0].device} alone (model parallel; no gradient sync).")
            continue
        types = Counter(_kind(prob, r.device) for r in g.replicas)
        kinds = ", ".join(f"{k}×{t}" for t, k in types.items())
        idx = [prob.device_names.index(r.device) for r in g.replicas] if prob.n_devices <= 64 else None
        line = f"{span}: data parallel on {len(g.replicas)} devices ({kinds}), sync {g.sync}"
        if g.ps_device:
            line += f" via a parameter server on {g.ps_device}"
        if idx is not None and len(set(np.round(speed[idx], 6))) > 1:
            share = {}
            for r, i in zip(g.replicas, idx):
                share.setdefault(_kind(prob, r.device), (r.share, speed[i]))
            desc = ", ".join(f"{t} {s * 100:.1f}%" for t, (s, _) in share.items())
            if len({round(s, 3) for s, _ in share.values()}) > 1:
                line += (f"; per-replica shares {desc}, balanced by the share LP so the replicas "
                         f"finish together (faster devices get more samples)")
            else:
                line += f"; equal shares ({desc} each) despite unequal speeds: memory caps bind"
        out.append(line + ".")
    if len(_segments(plan)) > 8:
        out.append(f"… {len(_segments(plan)) - 8} more segments of groups.")
    if plan.num_microbatches > 1:
        stages = len({tuple(r.device for r in plan.groups[a].replicas) for a, _ in _segments(plan)})
        if stages == 1 and plan.schedule == "1f1b":
            out.append(f"{plan.num_microbatches} micro-batches accumulate gradients (1F1B on one stage): "
                       f"only one micro-batch's activations are live at a time, which lowers peak memory.")
        elif stages == 1:
            out.append(f"{plan.num_microbatches} micro-batches per iteration (gpipe).")
        else:
            extra = (" 1F1B keeps at most one micro-batch per later stage in flight, which bounds activation memory."
                     if plan.schedule == "1f1b" else "")
            out.append(f"{plan.num_microbatches} micro-batches per iteration ({plan.schedule}) keep the "
                       f"{stages} stages busy.{extra}")
    if any(g.recompute for g in plan.groups):
        k = sum(g.recompute for g in plan.groups)
        out.append(f"{k} group(s) recompute activations in backward: less activation memory for a "
                   f"second forward pass.")
    tight = sorted(((b / prob.cluster.memory_bytes(d), d) for d, b in plan.predicted_peak_memory_bytes.items()),
                   reverse=True)[:1]
    for frac, d in tight:
        out.append(f"tightest memory: {d} at {frac * 100:.0f}% of {human_bytes(prob.cluster.memory_bytes(d))}.")
    return out


def infeasible_message(prob: "Problem", candidates: Sequence["Candidate"]) -> str:
    """Name the smallest per-device memory any plan we found would need."""
    best_need, best_dev, best_name = None, None, None
    for c in candidates:
        if not c.peak_memory_bytes:
            continue
        dev, need = max(c.peak_memory_bytes.items(), key=lambda kv: kv[1])
        if best_need is None or need < best_need:
            best_need, best_dev, best_name = need, dev, c.strategy
    largest = max(prob.cluster.memory_bytes(d) for d in prob.device_names)
    total_state = float(prob.persistent_bytes[:, prob.dev_class[prob.speed_order[0]]].sum())
    msg = (f"model {prob.graph.model!r} at batch {prob.batch_size} fits nowhere on cluster "
           f"{prob.cluster.name!r}: no strategy tried keeps every device within its memory. ")
    if best_need is not None:
        msg += (f"The smallest need found is {human_bytes(best_need)} on one device ({best_dev}, "
                f"strategy {best_name}); the largest device here has {human_bytes(largest)}. ")
    msg += (f"Parameters, gradients and optimizer state alone take {human_bytes(total_state)}. "
            f"Use devices with more memory, more devices, a smaller --batch-size, "
            f"--optimizer sgd instead of adamw, or amp-bf16 precision.")
    return msg
