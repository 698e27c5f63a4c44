"""The convex functions below a call's time that the lower bound (bound.py) charges calls
with: the batch sizes the cost model is asked at, the hull through whole sizes below its
times, the most samples a device computes in a window, and the tangents of b·h(b) that bound
the average sample's chain.

Assumptions about the cost model, both true of heterog's (cost/efficiency.py): a group's time
never falls as its samples grow, and its time per sample never rises (kernel efficiency grows
with size) — so between two measured sizes the time is at least max(t(b_k), b·t(b_k+1)/b_k+1).
Where the second does not hold between two sizes only the first is used there.
"""

from __future__ import annotations

import math

import numpy as np

EVERY_SIZE_UP_TO = 16  # replicas of a few samples: where per-kernel costs make h bend most
SIZE_STEP = 1.5


def sizes(batch: int) -> list[int]:
    """The batch sizes the cost model is asked at: every one up to EVERY_SIZE_UP_TO, then
    SIZE_STEP apart. Between two of them h falls back on the weaker rule of under, which
    at powers of two alone left a replica of 4 samples 11 % below its time (resnet200)."""
    out = list(range(1, min(batch, EVERY_SIZE_UP_TO) + 1))
    while out[-1] < batch:
        out.append(min(batch, max(out[-1] + 1, int(out[-1] * SIZE_STEP))))
    return out


def under(asked: list[int], times: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A convex piecewise-linear h ≤ t at every whole b in [1, B] from t at the sizes `asked`.
    A call computes whole samples (ir/plan.py split_samples, ir/accumulation.py), so h is the lower
    hull of points at whole sizes only: at the sizes asked, and between two that are not
    neighbours, where t(b) ≥ max(t(b_k), b·t(b_k+1)/b_k+1) (only t(b_k) where the time per
    sample rose), at the whole sizes either side of that function's corner. (A hull through
    the corner itself, at a fractional size, left resnet200's 4-sample replica 5 % below its
    time.) Returns (knots b, h at the knots, [intercept, slope] of each hull edge)."""
    pts = [(float(b), t) for b, t in zip(asked, times)]
    for (b0, t0), (b1, t1) in zip(zip(asked, times), zip(asked[1:], times[1:])):
        if b1 - b0 < 2:
            continue  # no whole size between them
        per = t1 / b1
        if per > 0 and per <= t0 / b0:
            corner = t0 / per  # in [b0, b1]: t0 up to it, b·per after
            lo, hi = math.floor(corner), math.ceil(corner)
            pts += [(float(lo), t0)] if b0 < lo < b1 else []
            pts += [(float(hi), hi * per)] if b0 < hi < b1 else []
        else:
            pts.append((float(b1 - 1), t0))
    hull: list[tuple[float, float]] = []
    for p in sorted(pts):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:  # hull[-1] on or above the chord
                hull.pop()
            else:
                break
        if hull and hull[-1][0] == p[0]:
            continue  # equal b: the lower point came first
        hull.append(p)
    knots = np.array([x for x, _ in hull])
    vals = np.array([y for _, y in hull])
    slopes = np.diff(vals) / np.maximum(np.diff(knots), 1e-300)
    edges = np.column_stack([vals[:-1] - slopes * knots[:-1], slopes]) if len(hull) > 1 else np.array([[vals[0], 0.0]])
    return knots, vals, edges


def b_max(knots: np.ndarray, vals: np.ndarray, budget_s: float) -> float:
    """The largest b in [1, B] with h(b) ≤ budget_s (0 when even one sample takes longer)."""
    if vals[0] > budget_s:
        return 0.0
    if vals[-1] <= budget_s:
        return float(knots[-1])
    return float(np.interp(budget_s, vals, knots))  # h is non-decreasing along its knots


def tangents(knots: np.ndarray, edges: np.ndarray) -> list[tuple[float, float]]:
    """Lines below the perspective k·φ(x/k) of φ(b) = b·h(b), as (coefficient of x, of k):
    φ is convex where h is convex and non-decreasing, so at any b0 and any slope m of h there,
    k·φ(x/k) ≥ (h(b0) + b0·m)·x − b0²·m·k (the tangent of φ at b0, scaled by k). Taken at
    the knots and inside each edge, where φ is quadratic."""
    out: list[tuple[float, float]] = []
    for i, (q, m) in enumerate(edges):
        lo = float(knots[i]) if len(knots) > 1 else float(knots[0])
        hi = float(knots[i + 1]) if len(knots) > 1 else lo
        for b0 in np.unique([lo, 0.5 * (lo + hi), hi]):
            out.append(((q + m * b0) + b0 * m, -b0 * b0 * m))
    return out
