"""A lower bound on the iteration time of every plan of a problem: the yardstick printed beside
each plan ("within X % of the bound").

No plan can do better than splitting every group's samples over the devices so that all of
them finish at once with nothing to wait for. The bound is the least time T for which such a
split exists, found by bisection over T on a linear programme (HiGHS via scipy), with one
entry per device *tier* and group (Problem.tiers; devices of a tier are interchangeable):

  x[t,g]  samples of group g that tier t computes   Σ_t x[t,g] = B
  y[t,g]  devices of tier t that compute group g    0 ≤ y ≤ n_t, y ≤ x (a sample each at least)
  z[t,g]  their compute time                        z ≥ y·h(x/y), x ≤ y·b_max(T)
  w[t,g]  the part of g's optimizer step on tier t  Σ_t w[t,g] = 1
          Σ_g z[t,g] + opt[t,g]·w[t,g] ≤ n_t·T      (a tier's devices are busy at most T each)

h is a convex function below one replica's forward + backward time at b samples (the cost
model at b = 1, 2, 4, …, B; see _under), so y·h(x/y) ≤ what y devices sharing x samples take
whatever the split (Jensen). b_max(T) is the most samples one device computes in T. Per-kernel
fixed costs make a device's first sample dear, so the LP chooses how many devices to use.

Communication every such plan must do: a group on y devices all-reduces its S gradient bytes,
which sends at least (y − 1)·S bytes in all (each replica sends all but its own part of the
sum; ring, tree, hierarchical and parameter servers all do), through the devices' ports, and
(k − 1)·S of them through the NICs of the k ≥ Σ_t y[t,g] / devices-per-node nodes it spans:

  Σ_g S_g·(Σ_t y[t,g] − 1) ≤ T·Σ_devices port bandwidth,   Σ_g S_g·u_g ≤ T·Σ_nodes NIC bandwidth,
  u_g ≥ Σ_t y[t,g] / D_t − 1, u_g ≥ 0.

Compute and communication may overlap, so they bound T side by side, not summed. Left out,
so the bound stays below every plan: activation transfers between stages, pipeline fill and
drain, latencies, recomputation, and memory (a split the bound uses may not fit).

Assumptions about the cost model, both true of heterog's (cost/efficiency.py): a group's time
never falls as its samples grow, and its time per sample never rises (kernel efficiency grows
with size) — so splitting a replica's samples into micro-batches never makes it faster, and
between two measured sizes the time is at least max(t(b_k), b·t(b_k+1)/b_k+1). Where the
second does not hold between two sizes only the first is used there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from heterog.hardware.cluster import Link
from heterog.search.problem import Problem

REL_TOL = 1e-2  # bisection stops when the bracket is this narrow, relative


@dataclass(frozen=True, kw_only=True, slots=True)
class Bound:
    iteration_time_s: float
    what: str = (
        "every device busy until the end: samples split to finish at once, per-kernel costs and optimizer "
        "steps counted, gradient bytes through ports and NICs; activation transfers, pipeline fill, "
        "latencies and memory left out"
    )

    def within(self, iteration_time_s: float) -> float:
        """How far above the bound a plan is, as a fraction (0.05: 5 % slower than the bound)."""
        return iteration_time_s / self.iteration_time_s - 1.0 if self.iteration_time_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_time_s": self.iteration_time_s, "what": self.what}


def _sizes(batch: int) -> list[int]:
    out, b = [], 1
    while b < batch:
        out.append(b)
        b *= 2
    return [*out, batch]


def _under(sizes: list[int], times: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A convex piecewise-linear h ≤ t on [1, B] from t at `sizes`: the lower hull of the
    corners of max(t(b_k), b·t(b_k+1)/b_k+1) on each [b_k, b_k+1] (only t(b_k) where the time
    per sample rose). Returns (knots b, h at the knots, [intercept, slope] of each hull edge)."""
    pts = [(float(sizes[0]), times[0])]
    for (b0, t0), (b1, t1) in zip(zip(sizes, times), zip(sizes[1:], times[1:])):
        per = t1 / b1
        corner = t0 / per if per > 0 and per <= t0 / b0 else float(b1)
        pts += [(min(max(corner, b0), b1), t0), (float(b1), t1)]
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


def _b_max(knots: np.ndarray, vals: np.ndarray, budget_s: float) -> float:
    """The largest b in [1, B] with h(b) ≤ budget_s (0 when even one sample takes longer)."""
    if vals[0] > budget_s:
        return 0.0
    if vals[-1] <= budget_s:
        return float(knots[-1])
    return float(np.interp(budget_s, vals, knots))  # h is non-decreasing along its knots


@dataclass(frozen=True, slots=True)
class _Tables:
    n: np.ndarray  # devices per tier
    per_node: np.ndarray  # devices per node of each tier
    under: list  # [t][g] → (knots, values, edges)
    opt_s: np.ndarray  # [t, g]
    grad_bytes: np.ndarray  # [g]
    port_bytes_per_s: float  # all devices' ports together
    nic_bytes_per_s: float  # all nodes' NICs together
    batch: int
    before_s: np.ndarray  # [g] the least time before any forward of group g can start
    after_s: np.ndarray  # [g] the least time after any backward of group g ends


def _suffix_min(x: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(x[::-1])[::-1]


def _total_bandwidth(links: list[Link | None]) -> float:
    """The links' summed bandwidth; unbounded when any of them is missing (not modelled)."""
    if any(link is None for link in links):
        return float("inf")
    return sum(link.bandwidth_bytes_per_s for link in links if link is not None)


def _chains(prob: Problem, fwd1: np.ndarray, bwd1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the longest path over its ancestors of one sample's forward times (nothing
    of group g computes before one sample has passed them) and of its backward times (after
    g's backward of a sample, its ancestors' must follow); fastest tier's times."""
    before, after = np.zeros(prob.n_groups), np.zeros(prob.n_groups)
    for g in range(prob.n_groups):  # groups are in topological order
        for p in prob.preds[g]:
            before[g] = max(before[g], before[p] + fwd1[p])
            after[g] = max(after[g], after[p] + bwd1[p])
    return before, after


def _tables(prob: Problem) -> _Tables:
    c = prob.cluster
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    sizes = _sizes(prob.batch_size)
    by_class: dict[int, list] = {}
    under, opt = [], np.zeros((len(prob.tiers), prob.n_groups))
    fwd1 = np.full(prob.n_groups, np.inf)
    bwd1 = np.full(prob.n_groups, np.inf)
    for t, devs in enumerate(prob.tiers):
        rep = prob.device_names[devs[0]]
        cls = int(prob.dev_class[devs[0]])
        if cls not in by_class:
            rows = []
            for g, names in enumerate(prob.groups):
                one = table.times_s(tuple(names), rep, 1)
                fwd1[g], bwd1[g] = min(fwd1[g], one[0]), min(bwd1[g], one[1])
                times = [sum(table.times_s(tuple(names), rep, b)) for b in sizes]
                rows.append(_under(sizes, times))
            by_class[cls] = rows
        under.append(by_class[cls])
        opt[t] = [table.optimizer_s(tuple(names), rep) for names in prob.groups]
    before, after = _chains(prob, fwd1, bwd1)
    node = {n.name: n for n in c.nodes}
    per_node = np.array([len(node[c.devices[devs[0]].node].devices) for devs in prob.tiers], dtype=float)
    port = _total_bandwidth([c.links.get(c.port(d.name, "up")) for d in c.devices])
    nic = _total_bandwidth([c.links.get(c.nic(n.name, "up")) for n in c.nodes])
    return _Tables(
        n=np.array([len(d) for d in prob.tiers], dtype=float),
        per_node=per_node,
        under=under,
        opt_s=opt,
        grad_bytes=np.asarray(prob.grad_bytes, dtype=float),
        port_bytes_per_s=port,
        nic_bytes_per_s=nic,
        batch=prob.batch_size,
        before_s=before,
        after_s=after,
    )


class _Programme:
    """The LP of the module docstring, built once; feasible(T) sets what depends on T (each
    device's most samples, the tiers' and links' capacities) and solves it."""

    def __init__(self, tb: _Tables):
        self.tb = tb
        n_t, n_g = tb.opt_s.shape
        self.nv = nv = 4 * n_t * n_g + n_g  # x, y, z, w per (t, g), then u per g

        def v(kind: int, t: int, g: int) -> int:
            return (kind * n_t + t) * n_g + g

        rows: list[int] = []
        cols: list[int] = []
        data: list[float] = []
        rhs: list[float] = []

        def row(entries: list[tuple[int, float]], bound: float) -> int:
            for col, val in entries:
                rows.append(len(rhs))
                cols.append(col)
                data.append(val)
            rhs.append(bound)
            return len(rhs) - 1

        self.cap_entries: list[tuple[int, int, int]] = []  # (index into data, t, g) of −b_max(T)
        self.tier_rows: list[int] = []
        self.late_rows: list[tuple[int, int, int]] = []  # (row, tier, group)
        for t in range(n_t):
            for g in range(n_g):
                x, y, z = v(0, t, g), v(1, t, g), v(2, t, g)
                for q, m in tb.under[t][g][2]:
                    row([(y, q), (x, m), (z, -1.0)], 0.0)  # z ≥ y·h(x/y), one edge of h at a time
                row([(y, 1.0), (x, -1.0)], 0.0)
                self.cap_entries.append((len(data) + 1, t, g))
                row([(x, 1.0), (y, 0.0)], 0.0)
            entries = [(v(2, t, g), 1.0) for g in range(n_g)] + [(v(3, t, g), tb.opt_s[t, g]) for g in range(n_g)]
            self.tier_rows.append(row(entries, 0.0))
            # a device's work on groups g, g+1, … lies between the least of their before_s and
            # the end less the least of their after_s
            for g in range(1, n_g):
                self.late_rows.append((row([(v(2, t, k), 1.0) for k in range(g, n_g)], 0.0), t, g))
        S = tb.grad_bytes
        self.port_row = self.nic_row = None
        if np.isfinite(tb.port_bytes_per_s):
            self.port_row = row([(v(1, t, g), S[g]) for t in range(n_t) for g in range(n_g)], 0.0)
        if np.isfinite(tb.nic_bytes_per_s):
            u0 = 4 * n_t * n_g
            for g in range(n_g):
                row([(v(1, t, g), 1.0 / tb.per_node[t]) for t in range(n_t)] + [(u0 + g, -1.0)], 1.0)
            self.nic_row = row([(u0 + g, S[g]) for g in range(n_g)], 0.0)
        self.rows, self.cols = np.array(rows), np.array(cols)
        self.data, self.rhs = np.array(data), np.array(rhs)
        eq_rows = [g for _ in range(n_t) for g in range(n_g)]
        eq_cols_x = [v(0, t, g) for t in range(n_t) for g in range(n_g)]
        eq_cols_w = [v(3, t, g) for t in range(n_t) for g in range(n_g)]
        self.a_eq = coo_matrix(
            ([1.0] * (2 * n_t * n_g), (eq_rows + [n_g + g for g in eq_rows], eq_cols_x + eq_cols_w)),
            shape=(2 * n_g, nv),
        )
        self.b_eq = [float(tb.batch)] * n_g + [1.0] * n_g
        self.y = [v(1, t, g) for t in range(n_t) for g in range(n_g)]
        self.w = eq_cols_w

    def feasible(self, T: float) -> bool:
        """Is there a split that finishes within T?"""
        tb = self.tb
        data, rhs = self.data.copy(), self.rhs.copy()
        bounds: list[tuple[float, float | None]] = [(0.0, None)] * self.nv
        for col in self.w:
            bounds[col] = (0.0, 1.0)
        for (i, t, g), col in zip(self.cap_entries, self.y):
            knots, vals, _ = tb.under[t][g]
            cap = _b_max(knots, vals, T - tb.before_s[g] - tb.after_s[g])  # a replica's window for g
            data[i] = -cap
            bounds[col] = (0.0, 0.0 if cap == 0 else float(tb.n[t]))
        rhs[self.tier_rows] = tb.n * T
        wait = _suffix_min(tb.before_s) + _suffix_min(tb.after_s)
        for r, t, g in self.late_rows:
            rhs[r] = tb.n[t] * (T - wait[g])
        if self.port_row is not None:
            rhs[self.port_row] = T * tb.port_bytes_per_s + tb.grad_bytes.sum()
        if self.nic_row is not None:
            rhs[self.nic_row] = T * tb.nic_bytes_per_s
        a_ub = coo_matrix((data, (self.rows, self.cols)), shape=(len(rhs), self.nv))
        res = linprog(
            np.zeros(self.nv), A_ub=a_ub, b_ub=rhs, A_eq=self.a_eq, b_eq=self.b_eq, bounds=bounds, method="highs"
        )
        return res.status != 2  # 2: infeasible; anything else counts as feasible, so the bound stays low


def _bisect(lp: _Programme, hi: float) -> float:
    lo = 0.0
    while hi - lo > REL_TOL * hi:
        mid = 0.5 * (lo + hi)
        if lp.feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo  # infeasible below lo: lo is a bound, hi is not


def lower_bound(prob: Problem, upper_s: float | None = None) -> Bound:
    """The bound of the module docstring for `prob`. upper_s: the iteration time of a plan
    already known (the best baseline's), where the bisection starts."""
    tb = _tables(prob)
    # one device of the fastest tier doing everything is always a feasible split
    hi = min(sum(float(tb.under[t][g][1][-1]) + tb.opt_s[t, g] for g in range(prob.n_groups)) for t in range(len(tb.n)))
    if upper_s is not None and upper_s > 0:
        hi = min(hi, upper_s)
    return Bound(iteration_time_s=_bisect(_Programme(tb), hi))
