"""A lower bound on the iteration time of every plan of a problem: the yardstick printed beside
each plan ("within X % of the bound").

No plan can do better than splitting every group's samples over the devices so that all of
them finish at once with nothing to wait for. The bound is the least time T for which such a
split exists, found by bisection over T on a linear programme (HiGHS via scipy), with one
entry per device *tier* and group (Problem.tiers; devices of a tier are interchangeable):

  x[t,g]  samples of group g that tier t computes   Σ_t x[t,g] = B
  y[t,g]  devices of tier t that compute group g    0 ≤ y ≤ n_t, x ≤ y·b_max(T)
  k[t,g]  their calls (a replica's micro-batches)   y ≤ k ≤ x (a sample each at least)
  z[t,g]  their compute time                        z ≥ k·h(x/k)
  w[t,g]  the part of g's optimizer step on tier t  Σ_t w[t,g] = 1
          Σ_g z[t,g] + opt[t,g]·w[t,g] ≤ n_t·T      (a tier's devices are busy at most T each)

h is a convex function below one replica's forward + backward time at every whole number b
of samples (a call computes whole samples; call_hull.py), so k·h(x/k) ≤ what k calls sharing
x samples take whatever the split (Jensen). b_max(T) is the most samples one device computes
in T. Per-kernel fixed costs make a device's first sample dear, so the LP chooses how many
devices and calls.

The chain: every sample passes the groups of a path P through the group DAG forward and back,
each time in one call (a task of the simulator: lower/blocks.py), so T is at least the
average sample's chain, Σ_{g∈P} Σ_calls (m/B)·h(m) ≥ Σ_{g∈P} Σ_t c[t,g], where
c[t,g] ≥ (x/B)·h(x/k) (Jensen on φ(b) = b·h(b), by its tangents: call_hull.tangents): many
small calls shorten the chain and cost fixed costs; few large ones the reverse.

Queues on the chain (_queue_rows): a device computes its calls of a group one after another,
so the average one of its samples starts g's forward behind half of the device's others and
ends g's backward as long before the end. Each group g of P gives a row: the chain from g's
forward to its backward, with that queue, fits in T less one sample's way to g and back. One
large group on few devices must wait for itself; spread, it costs calls and crossings.

Activations: a sample whose producer group a and consumer group b run on different devices
sends a's tensor that b reads forward and its gradient back (lower/transfers.py); at most
min(x[t,a], x[t,b]) of tier t's samples stay on it, and the others' bytes leave through its
devices' ports within T (and through all ports together, with the gradients below). Where a
tier's nodes hold no other tier's devices, those bytes leave through its nodes' NICs too, and
where every tier's do, all of them pass the NICs with the gradients, and each crossing sample
of an edge of P adds its bytes over the fastest NIC, and a NIC's latency, each way, to the
chain.

Communication every such plan must do: a group on y devices all-reduces its S gradient bytes,
which sends at least (y − 1)·S bytes in all (each replica sends all but its own part of the
sum; ring, tree, hierarchical and parameter servers all do), through the devices' ports, and
(k − 1)·S of them through the NICs of the k ≥ Σ_t y[t,g] / devices-per-node nodes it spans:

  Σ_g S_g·(Σ_t y[t,g] − 1) ≤ T·Σ_devices port bandwidth,   Σ_g S_g·u_g ≤ T·Σ_nodes NIC bandwidth,
  u_g ≥ Σ_t y[t,g] / D_t − 1, u_g ≥ 0.

Compute and communication may overlap, so they bound T side by side, not summed. Left out,
so the bound stays below every plan: a crossing's time on the chain beyond one sample's bytes
(a transfer carries a call's samples), within a tier and where nodes hold two tiers, pipeline
fill and drain beyond one sample's and the queues, recomputation, and memory (a split the bound
uses may not fit). Where it is loose: a tier's devices count as one (activations between them
are free) and y, k are fractional, so a bubble-free pipeline of small micro-batches that hops
between tiers from group to group looks possible; plans shaped like the programme's optimum
simulate several times slower: their devices wait on each other's pieces of a micro-batch,
which averages over samples and a tier's devices do not see (resnet200's stay above twice the
bound with every link near-free).

Where the problem allows tensor parallelism, the rows are relaxed so that the bound holds for
plans whose replicas are tensor-parallel sets too (bound_tp.py: a group split d ways runs on
each member in its slice's time as the simulator prices it, and the chains and windows take
the quickest degree at each size; a set's d devices make its calls and sync as one replica).

Assumptions about the cost model, both true of heterog's (cost/efficiency.py): a group's time
never falls as its samples grow, and its time per sample never rises (kernel efficiency grows
with size) — so splitting a replica's samples into micro-batches never makes it faster
(call_hull.py reads the second between the sizes it asks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from heterog.search.bound_tables import Tables, chains, one_sample_times, tables
from heterog.search.bound_tp import tp_relaxation
from heterog.search.call_hull import b_max, tangents
from heterog.search.problem import Problem

REL_TOL = 1e-2  # bisection stops when the bracket is this narrow, relative
# the dual simplex decides most programmes in a tenth of a second but can stall near the
# boundary of feasibility, where the interior-point method still decides in about one
SOLVERS = (("highs-ds", 0.3), ("highs-ipm", 5.0))
QUEUE_TANGENTS_AT = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # samples a device where the queue rows touch x²/y


TP_WHAT = "; a tensor-parallel member: its slice of each split node and its all-reduces, as the cost model prices them"


@dataclass(frozen=True, kw_only=True, slots=True)
class Bound:
    iteration_time_s: float
    tensor_parallel: bool = False  # the rows relaxed so that it holds for tensor-parallel plans too
    plain_data_parallel_s: float | None = None  # no plain data-parallel plan is faster (dp_floor.py)
    what: str = (
        "every device busy until the end: samples split to finish at once, per-kernel costs per call, "
        "optimizer steps, the average sample's chain through the model with its queues at each device, "
        "gradient and activation bytes through ports and NICs counted; pipeline fill beyond one sample, "
        "most latencies and memory left out"
    )

    def within(self, iteration_time_s: float) -> float:
        """How far above the bound a plan is, as a fraction (0.05: 5 % slower than the bound)."""
        return iteration_time_s / self.iteration_time_s - 1.0 if self.iteration_time_s > 0 else float("inf")

    @property
    def floor_s(self) -> float | None:
        """Plain data parallelism's floor where it says more than the bound (is above it)."""
        floor = self.plain_data_parallel_s
        return floor if floor is not None and floor > self.iteration_time_s else None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Bound:
        """The bound of a plan result's JSON (to_dict); `what` is this version's."""
        return cls(
            iteration_time_s=float(doc["iteration_time_s"]),
            tensor_parallel=bool(doc.get("tensor_parallel", False)),
            plain_data_parallel_s=doc.get("plain_data_parallel_s"),
        )

    def to_dict(self) -> dict[str, Any]:
        what = self.what + (TP_WHAT if self.tensor_parallel else "")
        out = {"iteration_time_s": self.iteration_time_s, "what": what, "tensor_parallel": self.tensor_parallel}
        return {**out, "plain_data_parallel_s": self.plain_data_parallel_s}


def _suffix_min(x: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(x[::-1])[::-1]


def _per_device(member: dict[int, tuple], window_s: float) -> float:
    """The most samples per device when a replica has window_s for the group: b_max, or, where
    a set of d devices may split the group, b_max of a member's hull over d, at the best d."""
    return max(b_max(knots, vals, window_s) / d for d, (knots, vals, _) in member.items())


class _Programme:
    """The LP of the module docstring, built once; feasible(T) sets what depends on T (each
    device's most samples, the tiers' and links' capacities, the chain's length) and solves it."""

    KINDS = 6  # x, y, z, w, k (calls), c (the part of the average sample's chain) per (t, g)

    def __init__(self, tb: Tables):
        self.tb = tb
        n_t, n_g = tb.opt_s.shape
        self.stay0 = self.KINDS * n_t * n_g + n_g  # after u per g: samples that stay per (t, edge)
        self.queue0 = self.stay0 + n_t * len(tb.act_edges)  # then (e, q) per (t, group of the path)
        self.nv = nv = self.queue0 + 3 * n_t * len(tb.path)  # (e, q) per tier, and r, per group of the path
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.entries: list[float] = []
        self.bounds: list[float] = []
        self.cap_entries: list[tuple[int, int, int]] = []  # (index into data, t, g) of −b_max(T)
        self.tier_rows: list[int] = []
        self.late_rows: list[tuple[int, int, int]] = []  # (row, tier, group)
        for t in range(n_t):
            for g in range(n_g):
                self._split_rows(t, g)
            work = [(self.v(2, t, g), 1.0) for g in range(n_g)] + [
                (self.v(3, t, g), tb.opt_s[t, g]) for g in range(n_g)
            ]
            self.tier_rows.append(self.row(work, 0.0))
            # a device's work on groups g, g+1, … lies between the least of their before_s and
            # the end less the least of their after_s
            for g in range(1, n_g):
                self.late_rows.append((self.row([(self.v(2, t, k), 1.0) for k in range(g, n_g)], 0.0), t, g))
        self.chain_rows = self._queue_rows()
        # where no node holds two tiers, every activation that leaves a tier leaves its node
        self.leaves_nodes = bool(np.all(np.isfinite(tb.nic_by_tier)))
        self.crossing_bytes = 2.0 * tb.batch * sum(a for _, _, a in tb.act_edges)  # if no sample stayed
        self.tier_port_rows = self._activation_rows()
        S = tb.grad_bytes
        self.port_row = self.nic_row = None
        if np.isfinite(tb.port_bytes_per_s):
            per_s = 1.0 / tb.port_bytes_per_s  # rows in seconds, not bytes: HiGHS stalls on 1e9 coefficients
            stays = [(self.stay0 + i, -2.0 * a * per_s) for i, (t, (_, _, a)) in enumerate(self._stays())]
            grads = [(self.v(1, t, g), S[g] * per_s / tb.set_deg[t]) for t in range(n_t) for g in range(n_g)]
            self.port_row = self.row(grads + stays, 0.0)
        if np.isfinite(tb.nic_bytes_per_s):
            u0 = self.KINDS * n_t * n_g
            for g in range(n_g):
                self.row([(self.v(1, t, g), 1.0 / tb.per_node[t]) for t in range(n_t)] + [(u0 + g, -1.0)], 1.0)
            grads = [(u0 + g, S[g] / tb.nic_bytes_per_s) for g in range(n_g)]
            self.nic_row = self.row(grads + self._nic_stays(), 0.0)
        self.data, self.rhs = np.array(self.entries), np.array(self.bounds)
        eq_rows = [g for _ in range(n_t) for g in range(n_g)]
        eq_cols_x = [self.v(0, t, g) for t in range(n_t) for g in range(n_g)]
        eq_cols_w = [self.v(3, t, g) for t in range(n_t) for g in range(n_g)]
        self.a_eq = coo_matrix(
            ([1.0] * (2 * n_t * n_g), (eq_rows + [n_g + g for g in eq_rows], eq_cols_x + eq_cols_w)),
            shape=(2 * n_g, nv),
        )
        self.b_eq = [float(tb.batch)] * n_g + [1.0] * n_g
        self.y = [self.v(1, t, g) for t in range(n_t) for g in range(n_g)]
        self.w = eq_cols_w

    def v(self, kind: int, t: int, g: int) -> int:
        n_t, n_g = self.tb.opt_s.shape
        return (kind * n_t + t) * n_g + g

    def row(self, entries: list[tuple[int, float]], bound: float) -> int:
        """One row Σ coefficient·variable ≤ bound; returns its index."""
        for col, val in entries:
            self.rows.append(len(self.bounds))
            self.cols.append(col)
            self.entries.append(val)
        self.bounds.append(bound)
        return len(self.bounds) - 1

    def _nic_stays(self) -> list[tuple[int, float]]:
        """Where every activation that leaves a tier leaves its node: the samples that stay,
        against all crossing (feasible's right-hand side), in NIC seconds."""
        if not self.leaves_nodes:
            return []
        return [(self.stay0 + i, -2.0 * a / self.tb.nic_bytes_per_s) for i, (t, (_, _, a)) in enumerate(self._stays())]

    def _stays(self) -> list[tuple[int, tuple[int, int, float]]]:
        return [(t, e) for t in range(self.tb.opt_s.shape[0]) for e in self.tb.act_edges]

    def _activation_rows(self) -> list[int]:
        """Activations that must cross: of the samples of edge (a, b), those whose a and b run on
        one device stay, at most min(x[t,a], x[t,b]) on entry t; the others send the edge's bytes
        forward from a's device and their gradient back from b's, through the senders' ports and,
        where the tier holds its nodes alone, their NICs. Returns those rows (one per tier and
        link kind that is modelled)."""
        tb = self.tb
        sends: dict[int, list[tuple[int, float]]] = {}
        for i, (t, (a, b, nbytes)) in enumerate(self._stays()):
            stay = self.stay0 + i
            self.row([(stay, 1.0), (self.v(0, t, a), -1.0)], 0.0)
            self.row([(stay, 1.0), (self.v(0, t, b), -1.0)], 0.0)
            out_of_t = [(self.v(0, t, a), nbytes), (self.v(0, t, b), nbytes), (stay, -2.0 * nbytes)]
            sends.setdefault(t, []).extend(out_of_t)
        out = []
        for t, entries in sends.items():  # in seconds: through the tier's ports, and its nodes' NICs
            for per_s in (1.0 / tb.port_by_tier[t], 1.0 / tb.nic_by_tier[t]):
                if per_s > 0:
                    out.append(self.row([(col, val * per_s) for col, val in entries], 0.0))
        return out

    def _queue_rows(self) -> list[tuple[int, float]]:
        """The average sample's chain with the queue it meets: a device computes its calls of a
        group g one after another, so of its x_d samples the average one starts g's forward
        after ρ_f·(x_d² − Σ m²)/(2·x_d) of the others' forwards (and ends g's backward as long
        before the others' backwards end), ρ the least time per sample. For each g on the
        path P, every sample's time from g's forward to g's backward, plus its queues there,
        fits in T less before_s[g] and after_s[g]:
          r + Σ_t e[t,g] ≤ T − before_s[g] − after_s[g],
          e ≥ c[t,g],  e ≥ c[t,g]/2 + q,  q ≥ ρ·x²/(2·B·y)  (Σ_d x_d² ≥ x²/y; its tangents),
        where g's own calls and queue, Σ_i (m_i/B)·h(m_i) + ρ·(x_d² − Σ_i m_i²)/(2B), are at
        least half its calls plus ρ·x_d²/(2B) as h(m) ≥ ρ·m, and r is the chain after g: the
        calls of the groups after it on P and the time crossing samples of P's edges from g on
        spend between nodes (Tables.cross_s), summed backwards along P one group at a time
        (one row each, not one row of them all per g). Returns (row, before + after) per g."""
        tb = self.tb
        n_t, n_p = tb.opt_s.shape[0], len(tb.path)
        edge_at = {(a, b): j for j, (a, b, _) in enumerate(tb.act_edges)}
        later = self.queue0 + 2 * n_t * n_p  # r_i: the chain after P[i], r_i ≥ crossing_i + c(P[i+1]) + r_i+1
        out = []
        for i, g in enumerate(tb.path):
            if i + 1 < n_p:
                rest = [(self.v(5, t, tb.path[i + 1]), 1.0) for t in range(n_t)] + [(later + i, -1.0)]
                rest += [(later + i + 1, 1.0)] if i + 2 < n_p else []
                j = edge_at.get((g, tb.path[i + 1]))
                crossing = tb.cross_s[j] if j is not None else 0.0  # a sample that leaves its tier leaves its node
                if crossing > 0:
                    rest += [(self.stay0 + t * len(tb.act_edges) + j, -crossing / tb.batch) for t in range(n_t)]
                self.row(rest, -crossing)
            mine = [(later + i, 1.0)] if i + 1 < n_p else []
            for t in range(n_t):
                e = self.queue0 + 2 * (t * n_p + i)
                q = e + 1
                c, x, y = self.v(5, t, g), self.v(0, t, g), self.v(1, t, g)
                self.row([(c, 1.0), (e, -1.0)], 0.0)
                self.row([(c, 0.5), (q, 1.0), (e, -1.0)], 0.0)
                knots, vals, _ = tb.fastest[t][g]
                rho = float(np.min(vals / knots)) / (2.0 * tb.batch)
                for a in QUEUE_TANGENTS_AT:  # x²/y ≥ 2a·x − a²·y, a samples a device
                    self.row([(x, 2.0 * a * rho), (y, -a * a * rho), (q, -1.0)], 0.0)
                mine.append((e, 1.0))
            out.append((self.row(mine, 0.0), float(tb.before_s[g] + tb.after_s[g])))
        return out

    def _split_rows(self, t: int, g: int) -> None:
        """The rows of tier t's part of group g: its k calls (one per replica and micro-batch,
        each of one sample at least, on y ≤ k devices) cost z ≥ k·h(x/k) in all (Jensen), each
        device's part fits its window, and its calls' part of the average sample's chain is
        c ≥ Σ_calls (m/B)·h(m) ≥ (x/B)·h(x/k) (Jensen again, on φ)."""
        x, y, z, k, c = (self.v(kind, t, g) for kind in (0, 1, 2, 4, 5))
        knots, _, edges = self.tb.under[t][g]
        for q, m in edges:
            self.row([(k, q), (x, m), (z, -1.0)], 0.0)  # z ≥ k·h(x/k), one edge of h at a time
        self.row([(y, 1.0), (k, -self.tb.set_deg[t])], 0.0)  # a set's devices make its calls together
        self.row([(k, 1.0), (x, -1.0)], 0.0)
        self.cap_entries.append((len(self.entries) + 1, t, g))
        self.row([(x, 1.0), (y, 0.0)], 0.0)
        quickest = self.tb.fastest[t][g]  # a call on a member of a set of the quickest degree at its size
        for on_x, on_k in tangents(quickest[0], quickest[2]):
            self.row([(x, on_x), (k, on_k), (c, -float(self.tb.batch))], 0.0)

    def feasible(self, T: float) -> bool:
        """Is there a split that finishes within T?"""
        tb = self.tb
        data, rhs = self.data.copy(), self.rhs.copy()
        bounds: list[tuple[float, float | None]] = [(0.0, None)] * self.nv
        for col in self.w:
            bounds[col] = (0.0, 1.0)
        for (i, t, g), col in zip(self.cap_entries, self.y):
            cap = _per_device(tb.member[t][g], T - tb.before_s[g] - tb.after_s[g])
            data[i] = -cap
            bounds[col] = (0.0, 0.0 if cap == 0 else float(tb.n[t]))
        rhs[self.tier_rows] = tb.n * T
        for r, wait_s in self.chain_rows:
            rhs[r] = T - wait_s
        wait = _suffix_min(tb.before_s) + _suffix_min(tb.after_s)
        for r, t, g in self.late_rows:
            rhs[r] = tb.n[t] * (T - wait[g])
        rhs[self.tier_port_rows] = T
        if self.port_row is not None:
            rhs[self.port_row] = T + (tb.grad_bytes.sum() - self.crossing_bytes) / tb.port_bytes_per_s
        if self.nic_row is not None:
            through_nics = self.crossing_bytes if self.leaves_nodes else 0.0
            rhs[self.nic_row] = T - through_nics / tb.nic_bytes_per_s
        a_ub = coo_matrix((data, (np.array(self.rows), np.array(self.cols))), shape=(len(rhs), self.nv))
        for method, limit_s in SOLVERS:
            res = linprog(
                np.zeros(self.nv),
                A_ub=a_ub,
                b_ub=rhs,
                A_eq=self.a_eq,
                b_eq=self.b_eq,
                bounds=bounds,
                method=method,
                options={"time_limit": limit_s},
            )
            if res.status in (0, 2):
                return res.status == 0
        return True  # undecided counts as feasible, so the bound stays low


def _bisect(lp: _Programme, lo: float, hi: float, deadline_s: float) -> float:
    """The least T at which the programme is feasible, to REL_TOL, or as far as the bisection
    got by deadline_s (a perf_counter time): every infeasible T is a bound."""
    while hi - lo > REL_TOL * hi and time.perf_counter() < deadline_s:
        mid = 0.5 * (lo + hi)
        if lp.feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo  # infeasible below lo: lo is a bound, hi is not


def lower_bound(prob: Problem, upper_s: float | None = None, deadline_s: float = float("inf")) -> Bound:
    """The bound of the module docstring for `prob`. upper_s: the iteration time of a plan
    already known (the best baseline's), where the bisection starts. At deadline_s (a
    perf_counter time) the bisection stops with the best bound it has: at least one sample's
    time through the longest path, forward and back."""
    relax = tp_relaxation(prob)
    tp = relax.allowed
    fwd1, bwd1 = one_sample_times(prob, relax)
    before, after, _ = chains(prob, fwd1, bwd1)
    one_sample = float(np.max(before + after + fwd1 + bwd1))
    tb = tables(prob, fwd1, bwd1, deadline_s, relax) if time.perf_counter() < deadline_s else None
    if tb is None:
        return Bound(iteration_time_s=one_sample, tensor_parallel=tp)
    # one device of the fastest tier doing everything is always a feasible split
    hi = min(sum(float(tb.under[t][g][1][-1]) + tb.opt_s[t, g] for g in range(prob.n_groups)) for t in range(len(tb.n)))
    if upper_s is not None and upper_s > 0:
        hi = min(hi, upper_s)
    if one_sample >= hi:
        return Bound(iteration_time_s=hi, tensor_parallel=tp)
    return Bound(iteration_time_s=_bisect(_Programme(tb), one_sample, hi, deadline_s), tensor_parallel=tp)
