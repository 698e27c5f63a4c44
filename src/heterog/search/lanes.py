"""The planner's search lanes: each one anneals a chain (local_search.py) and keeps, of every
new best, the candidate the simulator scores — in this process or in a forked one, so that a
machine with two cores runs two lanes at once.

A lane's result depends on its seed and on how many moves its deadline let it run, never on
when it stopped otherwise: a candidate is scored the moment its chain finds it (`finalize`),
so the lane's candidate is the minimum over a prefix of the chain, and a longer prefix (a
larger budget, the same seed) never gives a worse one.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from heterog.errors import PlanError
from heterog.search.estimate import Estimate, estimate
from heterog.search.local_search import Annealer, Found
from heterog.search.problem import Problem, Strategy
from heterog.search.tp_scoring import simulated, tp_conflict
from heterog.simulate.priorities import assign_priorities

PRIORITY_MAX_DEVICES = 128  # ranking a larger plan's nodes (HEFT) costs seconds: graph order


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    strategy: str
    plan: Any  # heterog.ir.plan.Plan
    iteration_time_s: float
    feasible: bool
    peak_memory_bytes: dict[str, int]
    scored_by: str  # 'simulator' or 'estimate'
    above_bound: float | None = None  # (time − bound) / bound, once the planner knows the bound

    @property
    def rank(self) -> tuple[bool, float]:
        return (not self.feasible, self.iteration_time_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "iteration_time_s": self.iteration_time_s,
            "feasible": self.feasible,
            "peak_memory_bytes": self.peak_memory_bytes,
            "devices_used": len(self.plan.devices()),
            "num_microbatches": self.plan.num_microbatches,
            "scored_by": self.scored_by,
            "above_bound": self.above_bound,
            "cost": dict(self.plan.predicted_cost),  # search/objective.py; {} unpriced
        }


def _simulator() -> Callable | None:
    try:
        from heterog.simulate.simulator import simulate
    except ImportError:
        return None
    return simulate


def as_estimate(prob: Problem, r) -> Estimate:
    """A simulation (or a Candidate: its time, peaks and fit) as the chains' score: its time,
    inflated when memory overflows."""
    peak = np.zeros(prob.n_devices)
    for d, b in r.peak_memory_bytes.items():
        peak[prob.cluster.device_index[d]] = b
    overflow = float(np.max((peak - prob.memory_bytes) / prob.memory_bytes))
    return Estimate(
        iteration_time_s=float(r.iteration_time_s),
        peak_memory_bytes=peak,
        overflow=max(0.0, overflow) if not r.feasible else 0.0,
    )


def finalize(prob: Problem, s: Strategy, name: str, scores: dict | None = None) -> Candidate:
    """The candidate of strategy `s`, by the simulator when present. The simulator orders
    groups by the plan's priorities: up to PRIORITY_MAX_DEVICES devices the plan is scored
    with HEFT-style priorities (heterog.simulate.priorities) and in plain graph order, and the
    faster is kept, so the prediction is for the plan exactly as returned. `scores` gets the
    graph-order score a chain would give `s` (so a chain starting from it need not simulate
    it again)."""
    plan = prob.to_plan(s, name)
    sim = _simulator()
    if sim is None:
        e = estimate(prob, prob.finalize(s))
        if scores is not None:
            scores[s.key()] = estimate(prob, s).score
        peak = {prob.device_names[i]: int(b) for i, b in enumerate(e.peak_memory_bytes) if b > 0}
        return Candidate(
            strategy=name,
            plan=plan,
            iteration_time_s=e.iteration_time_s,
            feasible=e.feasible,
            peak_memory_bytes=peak,
            scored_by="estimate",
        )
    variants = [plan]
    # first: on a tie the plan keeps its priorities (a tensor-parallel plan's nodes are ranked
    # by the split graph's costs, which the priorities do not read: graph order)
    if prob.n_devices <= PRIORITY_MAX_DEVICES and not plan.tensor_parallel:
        variants.insert(0, assign_priorities(prob.graph, prob.cluster, plan, prob.costs, cache=prob.sim_cache))
    best: Candidate | None = None
    for p in variants:
        r = simulated(prob, p, sim)
        if p is plan and scores is not None:
            scores[s.key()] = as_estimate(prob, r).score
        c = Candidate(
            strategy=name,
            plan=p,
            iteration_time_s=float(r.iteration_time_s),
            feasible=bool(r.feasible),
            peak_memory_bytes={d: int(b) for d, b in r.peak_memory_bytes.items()},
            scored_by="simulator",
        )
        if best is None or c.rank < best.rank:
            best = c
    assert best is not None  # variants holds the plan itself
    return best


def simulator_scorer(prob: Problem) -> Callable[[Problem, Strategy], Estimate]:
    """The simulator as a chain's scorer (plans in graph order, no timeline)."""
    sim = _simulator()
    assert sim is not None

    def score(p: Problem, s: Strategy) -> Estimate:
        rejected = Estimate(iteration_time_s=math.inf, peak_memory_bytes=np.zeros(p.n_devices), overflow=0.0)
        if tp_conflict(p, s) is not None:  # a neighbour the simulator refuses: never accepted
            return rejected
        plan = p.to_plan(s, "search")
        try:
            return as_estimate(p, simulated(p, plan, sim))
        except PlanError:
            if not plan.tensor_parallel:
                raise
            return rejected  # a refusal tp_conflict does not foresee rejects the neighbour, not the search

    return score


@dataclass(frozen=True, kw_only=True)
class Lane:
    """One chain: its candidate's name, its seed, and where it starts. `starts` makes the
    starting strategies inside the lane (the GNN's proposals are made there); the best start
    is itself a candidate when `start_name` is set. `known`: strategies the planner scored
    already (the baselines), by key: (the chain's score, the candidate)."""

    name: str
    seed: int
    starts: Callable[[Problem, float], Iterable[Strategy]]  # (problem, the lane's deadline) → starts
    start_name: str | None = None
    known: dict[tuple, tuple[float, Candidate]] = field(default_factory=dict)


@dataclass(kw_only=True)
class LaneStats:
    name: str
    time_s: dict[str, float] = field(default_factory=dict)  # where the lane's time went
    moves: int = 0
    new_bests: list[tuple[int, str, float]] = field(default_factory=list)  # (after moves, by move, score)
    cut_by: str = "moves"

    def to_dict(self) -> dict[str, Any]:
        return {"moves": self.moves, "new_bests": self.new_bests, "cut_by": self.cut_by, "time_s": self.time_s}


def run_lane(
    prob: Problem,
    lane: Lane,
    *,
    deadline_s: float,
    max_iters: int | None,
    use_simulator: bool,
    emit: Callable[[Candidate], None],
    progress: Callable[[float], None] | None = None,
    report: Callable[[LaneStats], None] | None = None,
) -> LaneStats:
    """Make the lane's starts, anneal until the deadline or max_iters, and emit the candidate
    of every new best (named after the lane; the best start's also as `start_name`); `report`
    gets the lane's figures so far at every new best and every few moves."""
    stats = LaneStats(name=lane.name, cut_by="running")
    finalize_s = [0.0]

    def keep(f: Found) -> None:
        t = time.perf_counter()
        hit = lane.known.get(f.strategy.key())
        if hit is not None:
            c = replace(hit[1], strategy=lane.name, plan=replace(hit[1].plan, strategy=lane.name))
        else:
            c = finalize(prob, f.strategy, lane.name)
        emit(c)
        if lane.start_name and f.moves == 0:
            emit(replace(c, strategy=lane.start_name, plan=replace(c.plan, strategy=lane.start_name)))
        finalize_s[0] += time.perf_counter() - t
        stats.new_bests.append((f.moves, f.move, f.score))
        if report is not None:
            report(stats)

    def moved(frac: float, moves: int) -> None:
        stats.moves = moves
        if progress is not None:
            progress(frac)
        if report is not None:
            report(stats)

    scorer = simulator_scorer(prob) if use_simulator else estimate
    t = time.perf_counter()
    r = Annealer(prob, lane.seed, scorer=scorer).run(
        lane.starts(prob, deadline_s),
        deadline_s=deadline_s,
        max_iters=max_iters,
        on_best=keep,
        progress=moved,
        known={k: v for k, (v, _) in lane.known.items()},
    )
    chain_s = time.perf_counter() - t
    stats.time_s = {"chain": chain_s - finalize_s[0], "finalize": finalize_s[0]}
    stats.moves, stats.cut_by = r.iterations, r.cut_by
    return stats


class Best:
    """The best candidate of each name, as lanes emit them."""

    def __init__(self) -> None:
        self.by_name: dict[str, Candidate] = {}

    def __call__(self, c: Candidate) -> None:
        if c.strategy not in self.by_name or c.rank < self.by_name[c.strategy].rank:
            self.by_name[c.strategy] = c


# -- a lane in a forked process --------------------------------------------------------------


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _child(conn, prob: Problem, lane: Lane, kwargs: dict) -> None:
    """A forked lane: every candidate goes to the parent the moment it is found, then the
    stats. The parent owns the signals: a stop (Ctrl-C) is its to handle, and its SIGTERM ends
    this process at once (the handlers and wake-up pipe the fork copied are the parent's).
    One intra-op thread: the GNN's torch must not use a thread pool the fork copied."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    try:
        stats = run_lane(
            prob,
            lane,
            emit=lambda c: conn.send(("candidate", c)),
            report=lambda st: conn.send(("stats", st)),
            **kwargs,
        )
        conn.send(("done", stats))
    except BaseException as e:  # sent to the parent, which raises it there
        try:
            conn.send(("error", e))
        except Exception as why:  # an exception that does not pickle: its text goes instead
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e} (in a search lane's process; {why})")))
    conn.close()


class Forked:
    """A lane in a forked copy of this process (it inherits the problem and its caches). A
    thread here reads what the lane sends as it comes — a plan pickles to more than a pipe
    holds, so an unread pipe would stall the lane at its first new best; `collect` gathers
    what it found by a deadline and ends it."""

    def __init__(self, prob: Problem, lane: Lane, **kwargs: Any):
        ctx = multiprocessing.get_context("fork")
        self.lane = lane
        self.since_s = time.perf_counter()
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child_conn, prob, lane, kwargs), daemon=True)
        self._proc.start()
        child_conn.close()
        self._candidates: list[Candidate] = []
        self._stats: LaneStats | None = None
        self._end: tuple[str, Any] | None = None  # ('done', stats), ('error', exception) or ('eof', None)
        self._ended = threading.Event()
        self._reader = threading.Thread(target=self._read, name=f"{lane.name} lane reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                kind, value = self._conn.recv()
                if kind == "candidate":
                    self._candidates.append(value)
                elif kind == "stats":
                    self._stats = value
                else:
                    self._end = (kind, value)
                    break
        except (EOFError, OSError):  # the process ended, or stop() closed the pipe
            self._end = self._end or ("eof", None)
        self._ended.set()

    def collect(self, emit: Callable[[Candidate], None], until_s: float) -> LaneStats:
        """Pass on every candidate the lane sent by the time it is done or until_s (a
        time.perf_counter() value) has passed; then end the process. What it sent by then is
        the best of a prefix of its moves; a lane still making its starts (importing the
        GNN, say) has found nothing and is cut."""
        self._ended.wait(max(0.0, until_s - time.perf_counter()))
        end = self._end
        self.stop()
        for c in list(self._candidates):
            emit(c)
        if end is not None and end[0] == "error":
            raise end[1]
        if end is not None and end[0] == "done":
            return end[1]
        if end is not None and end[0] == "eof" and self._proc.exitcode not in (0, None, -signal.SIGTERM):
            raise RuntimeError(
                f"the {self.lane.name!r} lane's process ended without a result (exit {self._proc.exitcode})"
            )
        return replace(self._stats or LaneStats(name=self.lane.name), cut_by="deadline (ended by the planner)")

    def stop(self) -> None:
        """End the process if it still runs."""
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(timeout=5)
        if self._proc.is_alive():  # SIGTERM ends it at once; this is a safety net
            self._proc.kill()
            self._proc.join()
        self._reader.join(timeout=5)
        self._conn.close()
