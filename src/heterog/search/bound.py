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
c[t,g] ≥ (x/B)·h(x/k) (Jensen on φ(b) = b·h(b), by its tangents: _tangents): many small
calls shorten the chain and cost fixed costs; few large ones the reverse.

Activations: a sample whose producer group a and consumer group b run on different devices
sends a's tensor that b reads forward and its gradient back (lower/transfers.py); at most
min(x[t,a], x[t,b]) of tier t's samples stay on it, and the others' bytes leave through its
devices' ports within T (and through all ports together, with the gradients below).

Communication every such plan must do: a group on y devices all-reduces its S gradient bytes,
which sends at least (y − 1)·S bytes in all (each replica sends all but its own part of the
sum; ring, tree, hierarchical and parameter servers all do), through the devices' ports, and
(k − 1)·S of them through the NICs of the k ≥ Σ_t y[t,g] / devices-per-node nodes it spans:

  Σ_g S_g·(Σ_t y[t,g] − 1) ≤ T·Σ_devices port bandwidth,   Σ_g S_g·u_g ≤ T·Σ_nodes NIC bandwidth,
  u_g ≥ Σ_t y[t,g] / D_t − 1, u_g ≥ 0.

Compute and communication may overlap, so they bound T side by side, not summed. Left out,
so the bound stays below every plan: the time activation transfers add to a sample's chain,
pipeline fill and drain beyond one sample's, latencies, recomputation, and memory (a split
the bound uses may not fit). Where it is loose: a tier's devices count as one (activations
between them are free) and y, k are fractional, so a bubble-free pipeline of small
micro-batches over the groups looks possible where per-kernel costs make real pipelines slow.

Where the problem allows tensor parallelism, the rows are relaxed so that the bound holds for
plans whose replicas are tensor-parallel sets too (bound_tp.py: a group split d ways runs in
1/d of its time on each member; a set's d devices make its calls and sync as one replica).

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

from heterog.cost.tensor_parallel import DEGREES
from heterog.hardware.cluster import Link
from heterog.search.bound_tp import TpRelaxation, member_times, tp_relaxation
from heterog.search.call_hull import b_max, sizes, tangents, under
from heterog.search.problem import Problem

REL_TOL = 1e-2  # bisection stops when the bracket is this narrow, relative
# the dual simplex decides most programmes in a tenth of a second but can stall near the
# boundary of feasibility, where the interior-point method still decides in about one
SOLVERS = (("highs-ds", 0.3), ("highs-ipm", 5.0))


TP_WHAT = "; a tensor-parallel member: its split nodes at 1/d of their time, the all-reduces at their least"


@dataclass(frozen=True, kw_only=True, slots=True)
class Bound:
    iteration_time_s: float
    tensor_parallel: bool = False  # the rows relaxed so that it holds for tensor-parallel plans too
    plain_data_parallel_s: float | None = None  # no plain data-parallel plan is faster (dp_floor.py)
    what: str = (
        "every device busy until the end: samples split to finish at once, per-kernel costs per call, "
        "optimizer steps, the average sample's chain through the model, gradient and activation bytes "
        "through ports and NICs counted; pipeline fill, latencies and memory left out"
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


def _per_device(member: dict[int, tuple], window_s: float) -> float:
    """The most samples per device when a replica has window_s for the group: b_max, or, where
    a set of d devices may split the group, b_max of a member's hull over d, at the best d."""
    return max(b_max(knots, vals, window_s) / d for d, (knots, vals, _) in member.items())


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
    path: tuple[int, ...]  # the groups of a longest path through the group DAG (one sample, fastest tier)
    act_edges: tuple[tuple[int, int, float], ...]  # (producer, consumer, bytes per sample only it reads)
    port_by_tier: np.ndarray  # [t] its devices' send ports together (inf: not modelled)
    set_deg: np.ndarray  # [t] the widest tensor-parallel set on the tier (bound_tp.py; 1: none)
    member: list  # [t][g] → {degree d: h's hull on a member of a set splitting g d ways} (d = 1: under)


def _suffix_min(x: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(x[::-1])[::-1]


def _total_bandwidth(links: list[Link | None]) -> float:
    """The links' summed bandwidth; unbounded when any of them is missing (not modelled)."""
    if any(link is None for link in links):
        return float("inf")
    return sum(link.bandwidth_bytes_per_s for link in links if link is not None)


def _chains(prob: Problem, fwd1: np.ndarray, bwd1: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Per group, the longest path over its ancestors of one sample's forward times (nothing
    of group g computes before one sample has passed them) and of its backward times (after
    g's backward of a sample, its ancestors' must follow); fastest tier's times. And the
    groups of the longest path by one sample's forward + backward, which every sample takes."""
    before, after = np.zeros(prob.n_groups), np.zeros(prob.n_groups)
    through, came_from = fwd1 + bwd1, [-1] * prob.n_groups
    for g in range(prob.n_groups):  # groups are in topological order
        for p in prob.preds[g]:
            before[g] = max(before[g], before[p] + fwd1[p])
            after[g] = max(after[g], after[p] + bwd1[p])
            if through[p] + fwd1[g] + bwd1[g] > through[g]:
                through[g], came_from[g] = through[p] + fwd1[g] + bwd1[g], p
    path, g = [], int(np.argmax(through))
    while g >= 0:
        path.append(g)
        g = came_from[g]
    return before, after, tuple(reversed(path))


def _exclusive_activations(prob: Problem) -> tuple[tuple[int, int, float], ...]:
    """Per pair of groups (a, b), the bytes per sample of a's tensors that b alone (of the
    other groups) reads: a sample whose a and b run on different devices sends them forward,
    and their gradient comes back (lower/transfers.py). Tensors read by several groups may
    cross once for all of them (lower/blocks.sent_once), so they are left out."""
    owner = {name: g for g, names in enumerate(prob.groups) for name in names}
    readers: dict[str, dict[int, float]] = {}
    for e in prob.graph.edges:
        a, b = owner[e.src], owner[e.dst]
        if a != b:
            mine = readers.setdefault(e.src, {})
            mine[b] = max(mine.get(b, 0.0), float(e.bytes.per_sample))
    out: dict[tuple[int, int], float] = {}
    for src, by_group in readers.items():
        if len(by_group) == 1:
            ((b, nbytes),) = by_group.items()
            out[(owner[src], b)] = out.get((owner[src], b), 0.0) + nbytes
    return tuple((a, b, nbytes) for (a, b), nbytes in sorted(out.items()) if nbytes > 0)


def _one_sample(prob: Problem, tp: TpRelaxation) -> tuple[np.ndarray, np.ndarray]:
    """Per group, one sample's forward and backward time on the fastest device class, on a
    member of the widest set that may split it (bound_tp.member_times)."""
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    widest = tp.split_deg.max(axis=0)
    one = np.array(
        [
            [
                member_times(table.times_s(tuple(names), rep, 1), table.times_s(split, rep, 1) if split else (0, 0), d)
                for names, split, d in zip(prob.groups, tp.split_nodes, widest)
            ]
            for rep in prob.class_rep
        ]
    )
    return one[:, :, 0].min(axis=0), one[:, :, 1].min(axis=0)


def _tables(prob: Problem, fwd1: np.ndarray, bwd1: np.ndarray, deadline_s: float, tp: TpRelaxation) -> _Tables | None:
    """The programme's inputs; None when deadline_s passes first (a second or two at a
    thousand devices: the cost model at every size, per class and group). fwd1, bwd1: one
    sample's times per group, on a member where a set may split the group."""
    c = prob.cluster
    table = prob.sim_cache.cost_table(prob.graph, prob.costs)
    asked = sizes(prob.batch_size)
    hulls: dict[tuple, tuple] = {}  # (class, group, 1) or (…, degree, links) → h's hull on a member
    whole: dict[tuple[int, int], list[float]] = {}  # (class, group) → its time per size
    split: dict[tuple[int, int], list[float] | None] = {}  # … of its split nodes
    tiers = prob.tiers
    unsplit, member, opt = [], [], np.zeros((len(tiers), prob.n_groups))

    def times(names: tuple[str, ...], rep: str) -> list[float]:
        return [sum(table.times_s(names, rep, b)) for b in asked]

    for t, devs in enumerate(tiers):
        rep = prob.device_names[devs[0]]
        cls = int(prob.dev_class[devs[0]])
        if time.perf_counter() >= deadline_s and (cls, 0, 1) not in hulls:
            return None
        mine = []
        for g, names in enumerate(prob.groups):
            if (cls, g, 1) not in hulls:
                whole[cls, g] = times(tuple(names), rep)
                hulls[cls, g, 1] = under(asked, whole[cls, g])
                split[cls, g] = times(tp.split_nodes[g], rep) if tp.split_nodes[g] else None
            at = tp.link[t] if tp.link else None  # a member's hull depends on its links too
            for d in (d for d in DEGREES if 1 < d <= tp.split_deg[t, g] and split[cls, g] is not None):
                if (cls, g, d, at) not in hulls:
                    ar = tp.allreduce_s(t, g, d, asked)
                    hulls[cls, g, d, at] = under(asked, member_times(whole[cls, g], split[cls, g], d, ar))
            mine.append(
                {d: hulls[(cls, g, 1) if d == 1 else (cls, g, d, at)] for d in DEGREES if d <= tp.split_deg[t, g]}
            )
        unsplit.append([m[1] for m in mine])
        member.append(mine)
        opt[t] = [table.optimizer_s(tuple(names), rep) for names in prob.groups]
    before, after, path = _chains(prob, fwd1, bwd1)
    node = {n.name: n for n in c.nodes}
    per_node = np.array([len(node[c.devices[devs[0]].node].devices) for devs in tiers], dtype=float)
    port = _total_bandwidth([c.links.get(c.port(d.name, "up")) for d in c.devices])
    port_by_tier = np.array(
        [_total_bandwidth([c.links.get(c.port(c.devices[d].name, "up")) for d in devs]) for devs in tiers]
    )
    nic = _total_bandwidth([c.links.get(c.nic(n.name, "up")) for n in c.nodes])
    return _Tables(
        n=np.array([len(d) for d in tiers], dtype=float),
        per_node=per_node,
        under=unsplit,
        opt_s=opt,
        grad_bytes=np.asarray(prob.grad_bytes, dtype=float),
        port_bytes_per_s=port,
        nic_bytes_per_s=nic,
        batch=prob.batch_size,
        before_s=before,
        after_s=after,
        path=path,
        act_edges=_exclusive_activations(prob),
        port_by_tier=port_by_tier,
        set_deg=tp.set_deg,
        member=member,
    )


class _Programme:
    """The LP of the module docstring, built once; feasible(T) sets what depends on T (each
    device's most samples, the tiers' and links' capacities, the chain's length) and solves it."""

    KINDS = 6  # x, y, z, w, k (calls), c (the part of the average sample's chain) per (t, g)

    def __init__(self, tb: _Tables):
        self.tb = tb
        n_t, n_g = tb.opt_s.shape
        self.stay0 = self.KINDS * n_t * n_g + n_g  # after u per g: samples that stay per (t, edge)
        self.nv = nv = self.stay0 + n_t * len(tb.act_edges)
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
        self.chain_row = self.row([(self.v(5, t, g), 1.0) for t in range(n_t) for g in tb.path], 0.0)
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
            self.nic_row = self.row([(u0 + g, S[g] / tb.nic_bytes_per_s) for g in range(n_g)], 0.0)
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

    def _stays(self) -> list[tuple[int, tuple[int, int, float]]]:
        return [(t, e) for t in range(self.tb.opt_s.shape[0]) for e in self.tb.act_edges]

    def _activation_rows(self) -> list[int]:
        """Activations that must cross: of the samples of edge (a, b), those whose a and b run on
        one device stay, at most min(x[t,a], x[t,b]) on entry t; the others send the edge's bytes
        forward from a's device and their gradient back from b's, through the senders' ports.
        Returns each entry's port row (−1 where its ports are not modelled)."""
        tb = self.tb
        sends: dict[int, list[tuple[int, float]]] = {}
        for i, (t, (a, b, nbytes)) in enumerate(self._stays()):
            stay = self.stay0 + i
            self.row([(stay, 1.0), (self.v(0, t, a), -1.0)], 0.0)
            self.row([(stay, 1.0), (self.v(0, t, b), -1.0)], 0.0)
            per_s = nbytes / tb.port_by_tier[t]  # seconds per sample through the entry's ports
            sends.setdefault(t, []).extend([(self.v(0, t, a), per_s), (self.v(0, t, b), per_s), (stay, -2.0 * per_s)])
        n_t = tb.opt_s.shape[0]
        return [self.row(sends[t], 0.0) if t in sends and np.isfinite(tb.port_by_tier[t]) else -1 for t in range(n_t)]

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
        widest = self.tb.member[t][g][max(self.tb.member[t][g])]  # a call on the widest set's member
        for on_x, on_k in tangents(widest[0], widest[2]):
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
        rhs[self.chain_row] = T
        wait = _suffix_min(tb.before_s) + _suffix_min(tb.after_s)
        for r, t, g in self.late_rows:
            rhs[r] = tb.n[t] * (T - wait[g])
        rhs[[r for r in self.tier_port_rows if r >= 0]] = T
        if self.port_row is not None:
            crossing = 2.0 * tb.batch * sum(a for _, _, a in tb.act_edges)  # if no sample stayed
            rhs[self.port_row] = T + (tb.grad_bytes.sum() - crossing) / tb.port_bytes_per_s
        if self.nic_row is not None:
            rhs[self.nic_row] = T
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
    fwd1, bwd1 = _one_sample(prob, relax)
    before, after, _ = _chains(prob, fwd1, bwd1)
    one_sample = float(np.max(before + after + fwd1 + bwd1))
    tb = _tables(prob, fwd1, bwd1, deadline_s, relax) if time.perf_counter() < deadline_s else None
    if tb is None:
        return Bound(iteration_time_s=one_sample, tensor_parallel=tp)
    # one device of the fastest tier doing everything is always a feasible split
    hi = min(sum(float(tb.under[t][g][1][-1]) + tb.opt_s[t, g] for g in range(prob.n_groups)) for t in range(len(tb.n)))
    if upper_s is not None and upper_s > 0:
        hi = min(hi, upper_s)
    if one_sample >= hi:
        return Bound(iteration_time_s=hi, tensor_parallel=tp)
    return Bound(iteration_time_s=_bisect(_Programme(tb), one_sample, hi, deadline_s), tensor_parallel=tp)
