"""Batch shares for a set of replicas: the split that finishes every replica at once.

For replicas i of one data-parallel segment, compute time is affine in the samples it gets,
t_i(s_i) = a_i + c_i·B·s_i (a_i: fixed per-kernel cost, c_i: time per sample on that device),
plus a per-replica extra e_i (e.g. the parameter server's extra traffic). The linear
programme (solved by HiGHS through scipy.optimize.linprog)

    minimise T  subject to  a_i + e_i + c_i·B·s_i ≤ T,  Σ s_i = 1,  0 ≤ s_i ≤ cap_i

balances finishing times; cap_i is the share whose activations still fit in device i's memory
after its persistent state (parameters, gradients, optimizer state). Without caps the optimum
is the closed form s_i ∝ 1/c_i when the a_i are equal. Integer sample counts follow by
largest remainder and a repair that moves single samples off the slowest replica while that
shortens the slowest finishing time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linprog

from heterog.search.problem import Problem


def replica_terms(
    prob: Problem, groups: Sequence[int], devices: Sequence[int], microbatches: int = 1, recompute: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(fixed_s, per_sample_s, free_memory_bytes, act_bytes_per_sample) per replica device."""
    dev = np.asarray(devices, dtype=np.int64)
    cls = prob.dev_class[dev]
    gs = list(groups)
    fixed = (prob.fwd[gs][:, cls, 0] + prob.bwd[gs][:, cls, 0]).sum(axis=0) * microbatches
    per = (prob.fwd[gs][:, cls, 1] + prob.bwd[gs][:, cls, 1]).sum(axis=0)
    if recompute:
        fixed = fixed + prob.fwd[gs][:, cls, 0].sum(axis=0) * microbatches
        per = per + prob.fwd[gs][:, cls, 1].sum(axis=0)
    persistent = prob.persistent_bytes[gs][:, cls].sum(axis=0)
    act = prob.act_per_sample[gs, 1 if recompute else 0].sum() + prob.workspace_per_sample[gs].max() / microbatches
    free = prob.memory_bytes[dev] - persistent
    return fixed, per, free, np.full(len(dev), act)


def optimal_shares(
    fixed_s: np.ndarray,
    per_sample_s: np.ndarray,
    batch: int,
    *,
    cap: np.ndarray | None = None,
    extra_s: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """Continuous shares minimising the slowest replica's time (the LP above), one per entry.

    counts: how many identical replicas each entry stands for (devices of one class); then
    Σ counts_i · s_i = 1 and each of them gets s_i, so a 1024-device segment of four classes
    is an LP of four shares. When the caps cannot hold the whole batch (Σ cap < 1) no split
    fits in memory; the shares returned are then proportional to the caps, the split that
    overflows least.
    """
    n = len(per_sample_s)
    mult = np.ones(n) if counts is None else np.asarray(counts, dtype=float)
    extra = np.zeros(n) if extra_s is None else np.asarray(extra_s, dtype=float)
    ub = np.ones(n) if cap is None else np.clip(np.asarray(cap, dtype=float), 0.0, 1.0)
    if n == 1:
        return np.ones(1) / mult
    if (ub * mult).sum() < 1.0 - 1e-9:
        w = np.maximum(ub, 1e-9)
        return w / (w * mult).sum()
    # variables: s_1..s_n, T ; minimise T
    c = np.zeros(n + 1)
    c[-1] = 1.0
    a_ub = np.zeros((n, n + 1))
    a_ub[np.arange(n), np.arange(n)] = per_sample_s * batch
    a_ub[:, -1] = -1.0
    b_ub = -(np.asarray(fixed_s, dtype=float) + extra)
    a_eq = np.zeros((1, n + 1))
    a_eq[0, :n] = mult
    bounds = [(0.0, float(u)) for u in ub] + [(0.0, None)]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    assert res.status == 0, f"share LP failed unexpectedly: {res.message}"
    s = np.clip(res.x[:n], 0.0, None)
    return s / (s * mult).sum()


def integer_samples(
    shares: np.ndarray, total: int, fixed_s: np.ndarray, per_sample_s: np.ndarray, cap_samples: np.ndarray | None = None
) -> np.ndarray:
    """Whole samples per replica: largest remainder, then move one sample at a time from the
    replica that finishes last to the one that would finish earliest, while that helps."""
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    caps = np.full(len(counts), total) if cap_samples is None else np.floor(cap_samples).astype(np.int64)
    for _ in range(4 * len(counts) + total):
        t = fixed_s * (counts > 0) + per_sample_s * counts
        worst = int(np.argmax(t))
        after = fixed_s + per_sample_s * (counts + 1)
        after[counts + 1 > caps] = np.inf
        after[worst] = np.inf
        best = int(np.argmin(after))
        if counts[worst] == 0 or not after[best] < t[worst] - 1e-15:
            break
        counts[worst] -= 1
        counts[best] += 1
    return counts


def balanced_shares(
    prob: Problem,
    groups: Sequence[int],
    devices: Sequence[int],
    *,
    microbatches: int = 1,
    recompute: bool = False,
    extra_s: np.ndarray | None = None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Devices that get samples and their shares, for `groups` replicated on `devices`.
    Devices of one class (and equal extra) have equal terms, so the LP has a share per class."""
    fixed, per, free, act = replica_terms(prob, groups, devices, microbatches, recompute)
    batch = prob.batch_size
    cap = np.where(act > 0, free / np.maximum(act * batch, 1e-30), np.where(free >= 0, 1.0, 0.0))
    kind = prob.dev_class[np.asarray(devices, dtype=np.int64)]
    if extra_s is not None:
        kind = np.unique(np.stack([kind, np.asarray(extra_s, dtype=float)]), axis=1, return_inverse=True)[1]
    _, first, inverse, counts = np.unique(kind, return_index=True, return_inverse=True, return_counts=True)
    extra = None if extra_s is None else np.asarray(extra_s, dtype=float)[first]
    shares = optimal_shares(fixed[first], per[first], batch, cap=cap[first], extra_s=extra, counts=counts)[inverse]
    mb = batch // microbatches if batch % microbatches == 0 else batch
    counts = integer_samples(shares, mb, fixed / microbatches, per, cap * mb if cap.sum() >= 1 else None)
    keep = [i for i in range(len(devices)) if counts[i] > 0]
    return tuple(int(devices[i]) for i in keep), tuple(float(counts[i]) / mb for i in keep)
