"""Measure per-node forward and backward times of a model on this machine's CPU.

Every leaf module call (an OpGraph node name: module path, '#k' on the k-th repeated call)
is timed with module hooks: forward from its pre-hook to its hook, backward from its full
backward pre-hook to its full backward hook. Loose ops are not timed here; the cost model
keeps its analytic estimate for them. Times are taken at a few batch sizes (the cost model
interpolates linearly between them, extrapolating along the last line; `profile_batch_sizes`
picks them densely where the CPU is not linear), over `repeats` rounds that each visit every
batch size, so that a slow spell of a shared machine spoils one round, not one batch size. HeteroG's
profiler took the minimum of 5 runs on dedicated GPUs (CoNEXT 2020); on a
shared CPU the minimum is a best case the ranks rarely see, so the median is the default.

clock='cpu' (default) measures the thread's CPU time, the quantity the emulated devices
are paced on (execute/emulation.py), so a profile taken on a busy machine still describes
the uncontended CPU; clock='wall' measures elapsed time. The result is a `heterog.cost.profile.Profile` for
device type 'cpu', which the emulated clusters' devices use; their slowdown multiplies it.

Time outside the leaf modules. The hooks see only leaf modules; the loss and the loose ops
between modules (residual adds, attention written as functions, reshapes) were left to the
analytic estimate, which on this CPU under-counted them: for the GPT-2 of the run-vs-sim
scenarios (vocab 32768, batch 16) the hooked nodes plus the estimate summed to 199 ms
forward and 258 ms backward, while the whole step measured 223 ms and 357 ms. So with a
graph, `measure_profile` also times each whole forward and backward without hooks and the
loss on its own (`attribute_unhooked`): the loss's time goes to the graph's loss nodes, the
rest of the unattributed time (whole − hooked nodes − loss) to the other nodes the hooks did
not see, in proportion to the bytes each moves (they are memory-bound ops), so every node
has a measured time and their sum is the measured step — also where the hooks' own cost
makes the hooked nodes alone exceed it (small batches), by scaling them down.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from heterog.cost.profile import Profile
from heterog.execute.emulation import keep_freed_memory
from heterog.hardware.cpu_probe import torch_threads
from heterog.inputs import RANK_THREADS
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import ModelSpec
from heterog.workload import Workload, build_model, global_batch, resolve_workload


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if name and len(m._modules) == 0]


@contextmanager
def _node_hooks(model: nn.Module, now: Callable[[], float]) -> Iterator[dict[str, dict[str, list[float]]]]:
    """Hooks on every leaf module while the block runs; yields node → {'fwd': [s…], 'bwd': [s…]}
    with one sample per call (node names count repeated calls from the block's start)."""
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"fwd": [], "bwd": []})
    calls: dict[str, int] = {}
    started: dict[tuple[str, str], list[tuple[str, float]]] = defaultdict(list)
    handles = []

    def node_name(path: str) -> str:
        k = calls.get(path, 0)
        calls[path] = k + 1
        return path if k == 0 else f"{path}#{k}"

    for path, m in _leaf_modules(model):

        def fwd_pre(mod, args, path=path):
            started[(path, "fwd")].append((node_name(path), now()))

        def fwd_post(mod, args, out, path=path):
            name, t0 = started[(path, "fwd")].pop()
            started[(path, "bwd_names")].append((name, 0.0))
            samples[name]["fwd"].append(now() - t0)

        def bwd_pre(mod, grad_out, path=path):
            name, _ = started[(path, "bwd_names")].pop()  # backward runs calls in reverse
            started[(path, "bwd")].append((name, now()))

        def bwd_post(mod, grad_in, grad_out, path=path):
            name, t0 = started[(path, "bwd")].pop()
            samples[name]["bwd"].append(now() - t0)

        handles += [
            m.register_forward_pre_hook(fwd_pre),
            m.register_forward_hook(fwd_post),
            m.register_full_backward_pre_hook(bwd_pre),
            m.register_full_backward_hook(bwd_post),
        ]
    try:
        yield samples
    finally:
        for h in handles:
            h.remove()


def _clock(clock: str) -> Callable[[], float]:
    return time.thread_time if clock == "cpu" else time.perf_counter


def _reduce(statistic: str) -> Callable[[list[float]], float]:
    return min if statistic == "min" else statistics.median


def _per_node(rounds: list[dict[str, dict[str, list[float]]]], reduce) -> dict[str, dict[str, float]]:
    merged: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"fwd": [], "bwd": []})
    for samples in rounds:
        for name, phases in samples.items():
            for phase, ts in phases.items():
                merged[name][phase] += ts
    return {n: {p: reduce(ts) for p, ts in v.items() if ts} for n, v in merged.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeStep:
    """One batch size's whole forward (model and loss) and backward, timed without hooks, and
    the loss alone (None where the model's output cannot be cut off from the loss)."""

    fwd_s: float
    bwd_s: float
    loss_fwd_s: float | None = None
    loss_bwd_s: float | None = None


def _leaves(out: Any) -> Any:
    """The model's output as fresh leaves that need grad (so the loss's backward stops there)."""
    return tree_map(
        lambda t: t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out
    )


def _whole_step(
    model: nn.Module, work: Workload, inputs: tuple, targets: Any, out: Any, now: Callable[[], float]
) -> tuple[float, float, float | None, float | None]:
    """One step without hooks — forward with the loss, backward — then the loss alone on the
    model's output `out` (None: an output the loss cannot take apart); four times."""
    model.zero_grad(set_to_none=True)
    t0 = now()
    loss = work.loss(model(*inputs), targets)
    t1 = now()
    loss.backward()
    t2 = now()
    if out is None:
        return t1 - t0, t2 - t1, None, None
    leaves = _leaves(out)
    t3 = now()
    loss = work.loss(leaves, targets)
    t4 = now()
    loss.backward()
    return t1 - t0, t2 - t1, t4 - t3, now() - t4


def _detached_output(model: nn.Module, work: Workload, inputs: tuple, targets: Any) -> Any:
    """The model's output for timing the loss alone, or None where the loss needs it whole."""
    try:
        with torch.no_grad():
            out = model(*inputs)
        work.loss(_leaves(out), targets)
        return out
    except (TypeError, RuntimeError):
        return None


def _whole(rounds: list[tuple], reduce) -> WholeStep:
    fwd, bwd, lf, lb = zip(*rounds)
    return WholeStep(
        fwd_s=reduce(fwd),
        bwd_s=reduce(bwd),
        loss_fwd_s=reduce(lf) if lf[0] is not None else None,
        loss_bwd_s=reduce(lb) if lb[0] is not None else None,
    )


def attribute_unhooked(
    node_times: dict[str, dict[str, float]], whole: WholeStep, graph, batch: float
) -> dict[str, dict[str, float]]:
    """Every node's time, so that per phase they sum to the whole step measured without hooks
    (module docstring): the loss's own time to the loss nodes, what the whole step took beyond
    the hooked nodes and the loss to the other unhooked nodes in proportion to the bytes each
    moves. Where the hooked nodes alone exceed it — the hooks' own cost, a large share of a
    small batch's step (a GPT-2 at batch 1: hooked 55 ms, the step 31 ms) — they are scaled
    down to fit and the loose nodes get nothing."""
    unseen = [n for n in graph.nodes if n.name not in node_times]
    losses = [n for n in unseen if str(n.kind) == "loss"] if whole.loss_fwd_s is not None else []
    others = [n for n in unseen if n not in losses]
    out: dict[str, dict[str, float]] = {n: dict(v) for n, v in node_times.items()}
    out.update({n.name: {} for n in unseen})
    for phase, total, loss_s in (("fwd", whole.fwd_s, whole.loss_fwd_s), ("bwd", whole.bwd_s, whole.loss_bwd_s)):
        hooked = sum(v.get(phase, 0.0) for v in node_times.values())
        loss_time_s = loss_s if losses and loss_s is not None else 0.0  # losses are found with the loss timed
        for n in losses:
            out[n.name][phase] = loss_time_s / len(losses)
        room = max(total - loss_time_s, 0.0)
        if hooked > room:
            for n, v in node_times.items():
                if phase in v:
                    out[n][phase] = v[phase] * room / hooked
        rest = max(room - hooked, 0.0)
        weights = [float((n.fwd_bytes if phase == "fwd" else n.bwd_bytes).at(batch)) for n in others]
        if sum(weights) <= 0:
            weights = [1.0] * len(others)
        for n, w in zip(others, weights):
            out[n.name][phase] = rest * w / sum(weights)
    return out


def profile_batch_sizes(batch: int) -> tuple[int, ...]:
    """The batch sizes to profile for a plan of global batch `batch`: the powers of two below
    it, its quarter and itself. A CPU step is not linear in the batch where pipelines'
    micro-batches and small shares fall (toy-cnn: batch 2 costs twice batch 1, batch 6 only
    1.5× batch 2), and the cost model interpolates linearly between the measured points."""
    sizes = {batch, max(1, batch // 4)}
    k = 1
    while k < batch:
        sizes.add(k)
        k *= 2
    return tuple(sorted(sizes))


def _grad_inputs(work: Workload, b: int, seed: int) -> tuple[tuple, Any]:
    """A batch whose floating inputs need grad (or the first module's backward hook would not fire)."""
    inputs, targets = global_batch(work, b, seed=seed, step=0)
    return tuple(
        x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs
    ), targets


def node_times_by_batch(
    model: nn.Module,
    work: Workload,
    batch_sizes: tuple[int, ...],
    *,
    repeats: int,
    graph=None,
    seed: int = 0,
    statistic: str = "median",
    clock: str = "cpu",
) -> dict[int, dict[str, dict[str, float]]]:
    """batch → node → {'fwd': s, 'bwd': s}, over `repeats` rounds after a warm-up round. A
    round takes one hooked step at every batch size and, with a graph, one whole step and the
    loss alone at each: a spell of a shared machine (this one's same step varies 450–665 ms
    within minutes) then lands on one round of every batch size, and the median drops it."""
    now, reduce = _clock(clock), _reduce(statistic)
    data = {b: _grad_inputs(work, b, seed) for b in batch_sizes}
    outputs = {b: _detached_output(model, work, *data[b]) for b in batch_sizes} if graph is not None else {}
    hooked: dict[int, list] = {b: [] for b in batch_sizes}
    whole: dict[int, list] = {b: [] for b in batch_sizes}
    for k in range(repeats + 1):  # the first pass warms up: allocator, kernel selection
        for b, (inputs, targets) in data.items():
            with _node_hooks(model, now) as samples:
                model.zero_grad(set_to_none=True)
                work.loss(model(*inputs), targets).backward()
            if k:
                hooked[b].append(samples)
            if graph is not None:
                w = _whole_step(model, work, inputs, targets, outputs[b], now)
                if k:
                    whole[b].append(w)
    out = {b: _per_node(hooked[b], reduce) for b in batch_sizes}
    if graph is not None:  # the time outside the hooked nodes, measured (module docstring)
        out = {b: attribute_unhooked(t, _whole(whole[b], reduce), graph, b) for b, t in out.items()}
    return out


def measure_profile(
    work: Workload,
    *,
    batch_sizes: tuple[int, ...],
    repeats: int = 5,
    threads: int = 1,
    device_type: str = "cpu",
    graph=None,
    seed: int = 0,
    statistic: str = "median",
    clock: str = "cpu",
) -> Profile:
    """A Profile of `work`'s leaf modules at `batch_sizes` on this CPU with `threads` threads,
    with freed memory kept for reuse as the ranks keep it (execute/emulation.py)."""
    keep_freed_memory()
    with torch_threads(threads):  # the caller's count afterwards
        model = build_model(work, seed=seed)
        by_batch = node_times_by_batch(
            model, work, tuple(batch_sizes), repeats=repeats, graph=graph, seed=seed, statistic=statistic, clock=clock
        )
    times: dict[str, dict[str, dict[str, list]]] = {}
    for b, node_times in by_batch.items():
        for node, phases in node_times.items():
            for phase, t in phases.items():
                times.setdefault(node, {}).setdefault(device_type, {}).setdefault(phase, []).append((float(b), t))
    if graph is not None:  # keep only nodes the graph knows (and say nothing about the rest)
        times = {n: v for n, v in times.items() if n in graph.index}
    frozen: dict[str, Any] = {
        n: {g: {p: tuple(sorted(pts)) for p, pts in ph.items()} for g, ph in by.items()} for n, by in times.items()
    }
    return Profile(
        model=work.name,
        precision="fp32",
        graph_fingerprint=graph.fingerprint() if graph is not None else "",
        times=frozen,
    )


def measured_profile(model: ModelSpec, graph: OpGraph, *, repeats: int = 5) -> Profile:
    """Per-node times of `model` measured on this CPU at one thread, as its ranks run it (a
    few seconds), at the batch sizes the cost model interpolates between
    (profile_batch_sizes) — a profile `inputs.model_inputs` takes."""
    return measure_profile(
        resolve_workload(model),
        graph=graph,
        batch_sizes=profile_batch_sizes(model.batch_size),
        repeats=repeats,
        threads=RANK_THREADS,
    )
