"""Combinatorial search over group placements: an anytime annealing chain whose sequence of
moves depends on the seed alone.

A chain scores its starts, walks briefly from each promising one (different basins: data,
model, pipeline parallelism), then anneals from the best, restarting from its elite when
stuck. Each proposal draws a segment and a move from the registry (moves.py) by weight; a
worse strategy is accepted with probability exp(−Δ/(T·score)) (Kirkpatrick et al. 1983), T
halving every COOLING_MOVES moves. Nothing in the sequence reads a clock: the deadline and
max_moves only decide where it is cut. So the chain is *monotone* — a larger budget with the
same seed runs a longer prefix of the same moves, and its best (the minimum over the prefix)
is never worse — and *anytime*: every new best is reported (on_best) the moment it is found.

At TIER_PHASE_MIN_DEVICES devices and more the chain starts in the tier phase (whole tiers
of like devices, moves.MoveScope.TIER and ANY) and refines single devices once
TIER_PHASE_STALE_MOVES moves in a row found nothing better.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from heterog.search.estimate import Estimate, estimate
from heterog.search.moves import MOVES, Move, MoveContext, MoveScope, segments
from heterog.search.problem import Problem, Strategy

TIER_PHASE_MIN_DEVICES = 64  # below, one device is a step as large as a tier
TIER_PHASE_STALE_MOVES = 60
START_MOVES = 20  # the walk from each start within START_WITHIN of the best start
START_WITHIN = 1.5
RESTART_STALE_MOVES = 150
COOLING_MOVES = 300
T0 = 0.05  # initial temperature, relative to the current score
ELITE_SIZE = 8
PROGRESS_MOVES = 20

__all__ = ["Annealer", "SearchResult", "Found", "segments"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A new best of the chain: after how many moves, by which move ('start' for a start),
    its score, the strategy."""

    moves: int
    move: str
    score: float
    strategy: Strategy


@dataclass(kw_only=True)
class SearchResult:
    best: Strategy
    best_estimate: Estimate
    iterations: int  # moves proposed
    time_s: float
    found: list[Found] = field(default_factory=list)  # every new best, in order
    cut_by: str = "moves"  # what ended the chain: 'moves' (max_moves) or 'deadline'


class Annealer:
    def __init__(
        self,
        prob: Problem,
        seed: int = 0,
        *,
        scorer: Callable[[Problem, Strategy], Estimate] = estimate,
        tier_phase: bool | None = None,
    ):
        """scorer: what ranks the moves (the planner passes the simulator when there is one).
        tier_phase: start with whole-tier moves (default: at TIER_PHASE_MIN_DEVICES devices
        and more, when some tier has several devices)."""
        self.prob = prob
        self.rng = random.Random(seed)
        self.ctx = MoveContext(prob=prob, rng=self.rng)
        self.score_fn = scorer
        big = prob.n_devices >= TIER_PHASE_MIN_DEVICES and len(prob.tiers) < prob.n_devices
        self.tier_phase = big if tier_phase is None else tier_phase
        self._moves = {phase: self._table(prob, phase) for phase in (True, False)}
        self.last_move = "start"

    @staticmethod
    def _table(prob: Problem, tier_phase: bool) -> tuple[list[Move], list[float]]:
        """The registry's moves of a phase that apply to `prob`, and their weights, in registration order."""
        allowed = (MoveScope.TIER, MoveScope.ANY) if tier_phase else tuple(MoveScope)
        moves = [m for m in MOVES.values() if m.scope in allowed and (m.when is None or m.when(prob))]
        return moves, [m.weight for m in moves]

    def propose(self, s: Strategy) -> Strategy:
        """A neighbour of `s` (s itself when the drawn move does not apply)."""
        moves, weights = self._moves[self.tier_phase]
        a, b = self.rng.choice(segments(s))
        move = self.rng.choices(moves, weights=weights)[0]
        self.last_move = move.name
        return move.apply(self.ctx, s, a, b)

    def run(
        self,
        starts: Iterable[Strategy],
        *,
        deadline_s: float | None = None,
        budget_s: float | None = None,
        max_iters: int | None = None,
        on_best: Callable[[Found], None] | None = None,
        progress: Callable[[float, int], None] | None = None,
        known: dict[tuple, float] | None = None,
    ) -> SearchResult:
        """Anneal from `starts` until max_iters moves or the deadline (a time.perf_counter()
        value; budget_s: that many seconds from now), whichever comes first. The starts are
        always scored. progress(fraction of the time used, moves) is called every PROGRESS_MOVES;
        known: scores by strategy key that need not be computed again (the scorer's own)."""
        begin = time.perf_counter()
        if deadline_s is None:
            deadline_s = begin + budget_s if budget_s is not None else math.inf
        walk = _Walk(self, deadline_s, max_iters, on_best)
        walk.known = dict(known or {})
        if progress is not None:
            span = max(deadline_s - begin, 1e-9)
            walk.progress = lambda: progress(min(1.0, (time.perf_counter() - begin) / span), walk.moves)
        try:
            walk.all(starts)
        except _Cut as cut:
            walk.cut_by = cut.by
        best = walk.best
        assert best is not None, "a chain needs a start"
        return SearchResult(
            best=best,
            best_estimate=self.score_fn(self.prob, best),
            iterations=walk.moves,
            time_s=time.perf_counter() - begin,
            found=walk.found,
            cut_by=walk.cut_by,
        )


class _Cut(Exception):
    def __init__(self, by: str):
        self.by = by


class _Walk:
    """One run of a chain: the sequence of moves and what it found."""

    def __init__(self, ann: Annealer, deadline_s: float, max_moves: int | None, on_best):
        self.ann, self.deadline_s, self.max_moves, self.on_best = ann, deadline_s, max_moves, on_best
        self.moves = 0
        self.stale = 0  # moves since the last new best
        self.seen: dict[tuple, float] = {}
        self.elite: list[tuple[float, int, Strategy]] = []  # (score, order found, strategy)
        self.best: Strategy | None = None
        self.best_v = math.inf
        self.found: list[Found] = []
        self.cut_by = "moves"
        self.progress: Callable[[], None] | None = None
        self.known: dict[tuple, float] = {}

    def score(self, s: Strategy) -> float:
        k = s.key()
        v = self.seen.get(k)
        if v is None:
            v = self.known.get(k)
        if v is None:
            if self.best is not None and time.perf_counter() >= self.deadline_s:
                raise _Cut("deadline")
            v = self.ann.score_fn(self.ann.prob, s).score
        if k not in self.seen:
            self.seen[k] = v
            if len(self.elite) < ELITE_SIZE or v < self.elite[-1][0]:
                self.elite.append((v, len(self.seen), s))  # keys are unique: only unseen strategies get here
                self.elite.sort(key=lambda e: (e[0], e[1]))
                del self.elite[ELITE_SIZE:]
            if v < self.best_v * (1 - 1e-12):
                self.best, self.best_v, self.stale = s, v, 0
                f = Found(moves=self.moves, move=self.ann.last_move, score=v, strategy=s)
                self.found.append(f)
                if self.on_best is not None:
                    self.on_best(f)
        return v

    def step(self) -> None:
        if self.max_moves is not None and self.moves >= self.max_moves:
            raise _Cut("moves")
        # here too, not only where a new strategy is scored: a chain whose neighbours have all
        # been scored (a small problem, late in a long budget) draws them without end
        if self.best is not None and time.perf_counter() >= self.deadline_s:
            raise _Cut("deadline")
        self.moves += 1
        self.stale += 1
        if self.progress is not None and self.moves % PROGRESS_MOVES == 0:
            self.progress()
        ann = self.ann
        if ann.tier_phase and self.stale > TIER_PHASE_STALE_MOVES:
            ann.tier_phase = False  # the tiers have given what they can: refine single devices

    def anneal(self, cur: Strategy, cur_v: float, moves: int | None, restarts: bool) -> None:
        """Simulated annealing from `cur` for `moves` moves (None: until cut)."""
        rng, local = self.ann.rng, 0
        while moves is None or local < moves:
            self.step()
            local += 1
            cand = self.ann.propose(cur)
            if cand is cur:
                continue
            v = self.score(cand)
            temp = T0 * 0.5 ** (self.moves / COOLING_MOVES)
            if v < cur_v or rng.random() < math.exp(-(v - cur_v) / max(temp * cur_v, 1e-30)):
                cur, cur_v = cand, v
            if restarts and self.stale and self.stale % RESTART_STALE_MOVES == 0:
                cur_v, _, cur = rng.choice(self.elite)  # stuck: restart from an elite strategy

    def all(self, starts: Iterable[Strategy]) -> None:
        self.ann.last_move = "start"
        scored = []
        for i, s in enumerate(starts):  # the first is scored whatever the time: a chain has a best
            scored.append((self.score(s), i, s))
        distinct: list[tuple[float, int, Strategy]] = []
        keys: set[tuple] = set()
        for v, i, s in sorted(scored, key=lambda e: (e[0], e[1])):
            if s.key() not in keys:
                keys.add(s.key())
                distinct.append((v, i, s))
        top = distinct[0][0]
        self.anneal(distinct[0][2], top, 2 * START_MOVES, restarts=False)
        for v, _, s in distinct[1:]:
            if v <= START_WITHIN * top:
                self.anneal(s, v, START_MOVES, restarts=False)
        assert self.best is not None  # the starts above were scored
        self.anneal(self.best, self.best_v, None, restarts=True)
