"""Combinatorial search over group placements: local moves with simulated annealing.

State: a Strategy. A *segment* is a maximal run of consecutive groups with the same
placement (a data-parallel block, a pipeline stage). Moves (each followed, where devices
change, by the LP batch-share optimiser on the affected segment):
  move      – put one group (or a segment) on a single device (model parallelism);
  merge     – give a group its neighbour's placement (grows a segment);
  split     – cut a segment and give its tail half the devices (a new pipeline stage);
  drop/add  – remove a device from, or add one to, a segment's replica set;
  sync      – change a segment's gradient synchronisation (ring, tree, hierarchical, PS on
              a chosen device);
  micro     – change the number of micro-batches, or the schedule (GPipe / 1F1B);
  recompute – toggle activation recomputation on a segment (trades time for memory);
  reshare   – re-run the share optimiser on a segment;
  nudge     – move one or two samples of a micro-batch between two replicas of a segment.
Scored by `estimate` (estimate.py); a worse move is accepted with probability
exp(−Δ/(T·score)) (Kirkpatrick et al. 1983), T cooling geometrically with the iteration
count, so a run is reproducible for a seed and an iteration limit; the wall-clock budget
only cuts it short. Anytime: `best` is valid whenever it stops.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from heterog.ir.kinds import PipelineSchedule, SyncMethod
from heterog.search.estimate import Estimate, estimate
from heterog.search.problem import SYNC_CHOICES, Placement, Problem, Strategy
from heterog.search.shares import balanced_shares


@dataclass(kw_only=True)
class SearchResult:
    best: Strategy
    best_estimate: Estimate
    iterations: int
    time_s: float
    elite: list[tuple[float, Strategy]] = field(default_factory=list)  # best distinct, by score


def segments(s: Strategy) -> list[tuple[int, int]]:
    out, a = [], 0
    P = s.placements
    for g in range(1, len(P) + 1):
        if g == len(P) or P[g] != P[a]:
            out.append((a, g))
            a = g
    return out


def _with(s: Strategy, a: int, b: int, p: Placement) -> Strategy:
    P = list(s.placements)
    P[a:b] = [p] * (b - a)
    return Strategy(tuple(P), s.microbatches, s.schedule)


def _reshaped(
    prob: Problem, s: Strategy, a: int, b: int, devices: Sequence[int], sync: str, ps: int | None, recompute: bool
) -> Strategy:
    devs, shares = balanced_shares(
        prob, range(a, b), sorted(set(devices)), microbatches=s.microbatches, recompute=recompute
    )
    if len(devs) == 1:
        sync, ps = SyncMethod.NONE, None
    else:
        if sync == SyncMethod.NONE:
            sync = SyncMethod.RING
        if sync == SyncMethod.PS and ps not in devs:
            ps = devs[0]
        if sync != SyncMethod.PS:
            ps = None
    return _with(s, a, b, Placement(devs, shares, sync, ps, recompute))


class Annealer:
    def __init__(
        self,
        prob: Problem,
        seed: int = 0,
        *,
        elite_size: int = 8,
        scorer: Callable[[Problem, Strategy], Estimate] = estimate,
        verifier: Callable[[Problem, Strategy], Estimate] | None = None,
    ):
        """scorer ranks moves; verifier (the simulator, when the scorer is the faster
        estimate) re-scores every new best, and the result is the best by the verifier."""
        self.prob = prob
        self.verifier = verifier
        self.rng = random.Random(seed)
        self.score_fn = scorer
        self.elite_size = elite_size
        self.microbatch_choices = [m for m in (1, 2, 4, 8, 16, 32) if prob.batch_size % m == 0]
        fast = prob.speed_order
        # devices drawn for single-device moves: faster ones more often (rank-weighted)
        self.device_weights = [1.0 / (1 + r) ** 0.5 for r in range(len(fast))]
        self.fast = fast
        gb = [float(x) for x in prob.grad_bytes]
        self.grad_weights = gb if sum(gb) > 0 else None

    def _device(self) -> int:
        return self.rng.choices(self.fast, weights=self.device_weights)[0]

    def propose(self, s: Strategy) -> Strategy:
        rng, prob = self.rng, self.prob
        segs = segments(s)
        a, b = rng.choice(segs)
        p = s.placements[a]
        kind = rng.choices(
            ("move", "merge", "split", "drop", "add", "sync", "micro", "recompute", "reshare", "nudge"),
            weights=(3, 3, 2, 2, 2, 2, 1, 1, 1, 1),
        )[0]
        if kind == "move":
            r = rng.random()
            if r < 0.3:
                a = rng.randrange(prob.n_groups)
                b = a + 1
            elif r < 0.6 and self.grad_weights is not None:
                # parameter-heavy groups are where leaving data parallelism pays (HeteroG's
                # VGG result: fully connected layers on one device, convolutions replicated)
                a = rng.choices(range(prob.n_groups), weights=self.grad_weights)[0]
                b = a + 1
            return _reshaped(prob, s, a, b, [self._device()], SyncMethod.NONE, None, s.placements[a].recompute)
        if kind == "merge":
            g = rng.randrange(prob.n_groups)
            nb = g - 1 if (g == prob.n_groups - 1 or (g > 0 and rng.random() < 0.5)) else g + 1
            if not 0 <= nb < prob.n_groups:
                return s
            return _with(s, g, g + 1, s.placements[nb])
        if kind == "split":
            if b - a < 2 or len(p.devices) < 2:
                return s
            cut = rng.randrange(a + 1, b)
            devs = list(p.devices)
            half = rng.randrange(1, len(devs))
            head, tail = devs[:half], devs[half:]
            s = _reshaped(prob, s, a, cut, head, p.sync, p.ps, p.recompute)
            return _reshaped(prob, s, cut, b, tail, p.sync, p.ps, p.recompute)
        if kind == "drop":
            if len(p.devices) < 2:
                return s
            devs = list(p.devices)
            devs.remove(rng.choice(devs))
            return _reshaped(prob, s, a, b, devs, p.sync, p.ps, p.recompute)
        if kind == "add":
            free = [d for d in range(prob.n_devices) if d not in p.devices]
            if not free:
                return s
            # add several at once on big clusters, so a block can grow in reasonable time
            k = 1 if len(free) < 16 else rng.randint(1, max(1, len(free) // 4))
            add = rng.sample(free, k)
            return _reshaped(prob, s, a, b, [*p.devices, *add], p.sync, p.ps, p.recompute)
        if kind == "sync":
            if len(p.devices) < 2:
                return s
            sync = rng.choice(SYNC_CHOICES)
            ps = rng.choice(p.devices) if sync == SyncMethod.PS else None
            return _with(s, a, b, replace(p, sync=sync, ps=ps))
        if kind == "micro":
            if rng.random() < 0.3:
                return Strategy(
                    s.placements,
                    s.microbatches,
                    PipelineSchedule.ONE_F_ONE_B if s.schedule == PipelineSchedule.GPIPE else PipelineSchedule.GPIPE,
                )
            return Strategy(s.placements, rng.choice(self.microbatch_choices), s.schedule)
        if kind == "nudge":
            # the LP balances compute only; moving a few samples between two replicas can pay
            # off where transfers or memory, which it does not see, differ between devices
            if len(p.devices) < 2:
                return s
            i, j = rng.sample(range(len(p.devices)), 2)
            mb = prob.batch_size // s.microbatches if prob.batch_size % s.microbatches == 0 else prob.batch_size
            step = min(p.shares[i], rng.randint(1, 2) / mb)
            shares = list(p.shares)
            shares[i] -= step
            shares[j] += step
            keep = [k for k in range(len(shares)) if shares[k] > 1e-9]
            total = sum(shares[k] for k in keep)
            devs = tuple(p.devices[k] for k in keep)
            new_p = Placement(
                devs,
                tuple(shares[k] / total for k in keep),
                p.sync if len(devs) > 1 else SyncMethod.NONE,
                p.ps if len(devs) > 1 and p.ps in devs else None,
                p.recompute,
            )
            if new_p.sync == SyncMethod.PS and new_p.ps is None:
                new_p = replace(new_p, ps=devs[0])
            return _with(s, a, b, new_p)
        if kind == "recompute":
            return _reshaped(prob, s, a, b, p.devices, p.sync, p.ps, not p.recompute)
        return _reshaped(prob, s, a, b, p.devices, p.sync, p.ps, p.recompute)

    def run(
        self,
        starts: Sequence[Strategy],
        *,
        budget_s: float,
        max_iters: int | None = None,
        t0: float = 0.05,
        cooling_iters: int = 2000,
        progress: Callable[[float], None] | None = None,
    ) -> SearchResult:
        """Anneal from the best of `starts`; restart from the elite when stuck."""
        begin = time.perf_counter()
        seen: dict[tuple, float] = {}
        elite: list[tuple[float, Strategy]] = []

        def score(s: Strategy) -> float:
            k = s.key()
            v = seen.get(k)
            if v is None:
                v = self.score_fn(self.prob, s).score
                seen[k] = v
                if len(elite) < self.elite_size or v < elite[-1][0]:
                    elite.append((v, s))  # keys are unique: only unseen strategies get here
                    elite.sort(key=lambda e: e[0])
                    del elite[self.elite_size :]
            return v

        state = {"it": 0, "best": None, "best_v": math.inf}

        def out_of_time(limit_it: int | None, t_end: float) -> bool:
            return (limit_it is not None and state["it"] >= limit_it) or time.perf_counter() >= t_end

        def walk(cur: Strategy, cur_v: float, limit_it: int | None, t_end: float, restarts: bool) -> None:
            """Simulated annealing from `cur` until the iteration limit or the deadline."""
            stale = 0
            local = 0
            while not out_of_time(limit_it, t_end):
                temp = t0 * 0.5 ** (local / cooling_iters)
                cand = self.propose(cur)
                state["it"] += 1
                local += 1
                if cand is cur:
                    continue
                v = score(cand)
                if v < cur_v or self.rng.random() < math.exp(-(v - cur_v) / max(temp * cur_v, 1e-30)):
                    cur, cur_v = cand, v
                if cur_v < state["best_v"] - 1e-15:
                    state["best"], state["best_v"], stale = cur, cur_v, 0
                    check(cur)
                else:
                    stale += 1
                if restarts and stale > 300:  # stuck: restart from a random elite strategy
                    cur_v, cur = self.rng.choice(elite)
                    stale = 0
                if progress is not None and state["it"] % 50 == 0:
                    progress(min(1.0, (time.perf_counter() - begin) / budget_s))

        verified: list = [math.inf, None]

        spent = [0.0]

        def check(st: Strategy) -> None:
            # verification may use at most a third of the budget; later new bests go unverified
            # (the planner still re-scores the elite with the simulator)
            if self.verifier is not None and (max_iters is not None or spent[0] < budget_s / 3):
                t = time.perf_counter()
                v = self.verifier(self.prob, st).score
                spent[0] += time.perf_counter() - t
                if v < verified[0]:
                    verified[0], verified[1] = v, st

        scored = sorted(((score(s), i) for i, s in enumerate(starts)))
        distinct: list[tuple[float, Strategy]] = []
        for v, i in scored:
            if all(starts[i].key() != d[1].key() for d in distinct):
                distinct.append((v, starts[i]))
        state["best_v"], state["best"] = distinct[0]
        for _, s0 in distinct:
            check(s0)
        # phase 1: a short anneal from every start (different basins: data, model, pipeline
        # parallelism), 40% of the budget; phase 2: continue from the best, with restarts
        deadline = begin + budget_s
        for k, (v, s0) in enumerate(distinct):
            frac = 0.4 * (k + 1) / len(distinct)
            limit = None if max_iters is None else int(max_iters * frac)
            walk(s0, v, limit, begin + budget_s * frac, restarts=False)
        walk(state["best"], state["best_v"], max_iters, deadline, restarts=True)
        best, it = state["best"], state["it"]
        if verified[1] is not None:
            best = verified[1]
            elite.insert(0, (state["best_v"], state["best"]))  # the scorer's own best stays a candidate
        return SearchResult(
            best=best,
            best_estimate=self.score_fn(self.prob, best),
            iterations=it,
            time_s=time.perf_counter() - begin,
            elite=elite,
        )


def anneal(
    prob: Problem,
    starts: Sequence[Strategy],
    *,
    budget_s: float,
    seed: int = 0,
    max_iters: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> SearchResult:
    return Annealer(prob, seed).run(starts, budget_s=budget_s, max_iters=max_iters, progress=progress)
