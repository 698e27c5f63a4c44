"""Measure per-node forward and backward times of a model on this machine's CPU.

Every leaf module call (an OpGraph node name: module path, '#k' on the k-th repeated call)
is timed with module hooks: forward from its pre-hook to its hook, backward from its full
backward pre-hook to its full backward hook. Loose ops are not timed here; the cost model
keeps its analytic estimate for them. Times are taken at a few batch sizes (the cost model
interpolates linearly between them, extrapolating along the last line), over `repeats`
runs each. HeteroG took the minimum of 5 runs on dedicated GPUs (REFERENCE.md); on a
shared CPU the minimum is a best case the ranks rarely see, so the median is the default.

clock='cpu' (default) measures the thread's CPU time, the quantity the emulated devices
are paced on (execute/emulation.py), so a profile taken on a busy machine still describes
the uncontended CPU; clock='wall' measures elapsed time. The result is a `heterog.cost.profile.Profile` for device type 'cpu', which the
emulated clusters' devices use; their slowdown multiplies it.

Time outside the leaf modules. The hooks see only leaf modules; the loss and the loose ops
between modules (residual adds, attention written as functions, reshapes) were left to the
analytic estimate, which on this CPU under-counted them: for the GPT-2 of the run-vs-sim
scenarios (vocab 32768, batch 16) the hooked nodes plus the estimate summed to 199 ms
forward and 258 ms backward, while the whole step measured 223 ms and 357 ms. So with a
graph, `measure_profile` also times each whole forward and backward without hooks and the
loss on its own (`whole_step_times`): the loss's time goes to the graph's loss nodes, the
rest of the unattributed time (whole − hooked nodes − loss) to the other nodes the hooks did
not see, in proportion to the bytes each moves (they are memory-bound ops), so every node
has a measured time and their sum is the measured step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from heterog.cost.profile import Profile
from heterog.execute.workload import Workload, build_model, global_batch


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if name and len(m._modules) == 0]


def time_nodes(model: nn.Module, run_step, *, repeats: int, statistic: str = "median",
               clock: str = "cpu") -> dict[str, dict[str, float]]:
    """node → {'fwd': s, 'bwd': s}: the median (or 'min') over `repeats` calls of run_step()."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
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

        handles += [m.register_forward_pre_hook(fwd_pre), m.register_forward_hook(fwd_post),
                    m.register_full_backward_pre_hook(bwd_pre), m.register_full_backward_hook(bwd_post)]
    try:
        run_step()  # warm-up: allocator, kernel selection
        samples.clear()
        for _ in range(repeats):
            calls.clear()
            started.clear()
            run_step()
    finally:
        for h in handles:
            h.remove()
    reduce = min if statistic == "min" else statistics.median
    return {n: {p: reduce(ts) for p, ts in v.items() if ts} for n, v in samples.items()}


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
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.detach().requires_grad_(True)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)


def whole_step_times(model: nn.Module, work: Workload, inputs: tuple, targets: Any, *, repeats: int,
                     statistic: str = "median", clock: str = "cpu") -> WholeStep:
    """Forward (model + loss) and backward of whole steps, and the loss alone, over `repeats`
    runs after a warm-up: the time the per-node hooks do not see is whole − their sum."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
    reduce = min if statistic == "min" else statistics.median

    fwd, bwd = _timed_steps(lambda: model.zero_grad(set_to_none=True), lambda _: model(*inputs),
                            work, targets, repeats, now)
    try:
        with torch.no_grad():
            out = model(*inputs)
        lf, lb = _timed_steps(lambda: _leaves(out), lambda leaves: leaves, work, targets, repeats, now)
    except (TypeError, RuntimeError):   # an output the loss needs whole (e.g. not a pytree)
        lf, lb = [], []
    return WholeStep(fwd_s=reduce(fwd), bwd_s=reduce(bwd), loss_fwd_s=reduce(lf) if lf else None,
                     loss_bwd_s=reduce(lb) if lb else None)


def _timed_steps(prepare: Callable[[], Any], forward: Callable[[Any], Any], work: Workload, targets: Any,
                 repeats: int, now: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Forward (forward(prepare()) and the loss) and backward times of `repeats` runs after a
    warm-up; prepare() runs untimed ahead of each."""
    fwd, bwd = [], []
    for k in range(repeats + 1):
        x = prepare()
        t0 = now()
        loss = work.loss(forward(x), targets)
        t1 = now()
        loss.backward()
        t2 = now()
        if k:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return fwd, bwd


def attribute_unhooked(node_times: dict[str, dict[str, float]], whole: WholeStep, graph,
                       batch: float) -> dict[str, dict[str, float]]:
    """Times for the graph nodes the hooks did not see, from what the whole step measured
    beyond the hooked nodes (see the module docstring): the loss's own time to the loss
    nodes, the rest to the other unhooked nodes in proportion to the bytes each moves."""
    unseen = [n for n in graph.nodes if n.name not in node_times]
    losses = [n for n in unseen if str(n.kind) == "loss"] if whole.loss_fwd_s is not None else []
    others = [n for n in unseen if n not in losses]
    out: dict[str, dict[str, float]] = {n.name: {} for n in unseen}
    for phase, total, loss_s in (("fwd", whole.fwd_s, whole.loss_fwd_s), ("bwd", whole.bwd_s, whole.loss_bwd_s)):
        hooked = sum(v.get(phase, 0.0) for v in node_times.values())
        for n in losses:
            out[n.name][phase] = loss_s / len(losses)
        rest = max(total - hooked - (loss_s if losses else 0.0), 0.0)
        weights = [float((n.fwd_bytes if phase == "fwd" else n.bwd_bytes).at(batch)) for n in others]
        if sum(weights) <= 0:
            weights = [1.0] * len(others)
        for n, w in zip(others, weights):
            out[n.name][phase] = rest * w / sum(weights) if weights else 0.0
    return out


def measure_profile(work: Workload, *, batch_sizes: tuple[int, ...], repeats: int = 5,
                    threads: int = 1, device_type: str = "cpu", graph=None, seed: int = 0,
                    statistic: str = "median", clock: str = "cpu") -> Profile:
    """A Profile of `work`'s leaf modules at `batch_sizes` on this CPU with `threads` threads."""
    torch.set_num_threads(threads)
    model = build_model(work, seed=seed)
    times: dict[str, dict[str, dict[str, list]]] = {}
    for b in batch_sizes:
        inputs, targets = global_batch(work, b, seed=seed, step=0)
        # the first module's inputs need grad, or its backward hook would not fire
        inputs = tuple(x.detach().requires_grad_(True) if isinstance(x, torch.Tensor)
                       and x.is_floating_point() else x for x in inputs)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            work.loss(model(*inputs), targets).backward()

        node_times = time_nodes(model, step, repeats=repeats, statistic=statistic, clock=clock)
        if graph is not None:   # the time outside the hooked nodes, measured (module docstring)
            whole = whole_step_times(model, work, inputs, targets, repeats=repeats, statistic=statistic,
                                     clock=clock)
            node_times = {**node_times, **attribute_unhooked(node_times, whole, graph, b)}
        for node, phases in node_times.items():
            for phase, t in phases.items():
                times.setdefault(node, {}).setdefault(device_type, {}).setdefault(phase, []).append((float(b), t))
    if graph is not None:  # keep only nodes the graph knows (and say nothing about the rest)
        times = {n: v for n, v in times.items() if n in graph.index}
    frozen: dict[str, Any] = {n: {g: {p: tuple(sorted(pts)) for p, pts in ph.items()} for g, ph in by.items()}
                              for n, by in times.items()}
    return Profile(model=work.name, precision="fp32",
                   graph_fingerprint=graph.fingerprint() if graph is not None else "", times=frozen)
