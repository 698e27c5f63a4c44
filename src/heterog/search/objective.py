"""What the planner minimises, and the final choice among its candidates.

The search lanes minimise the iteration time. The objective decides among the candidates
they and the baselines produced (planner._choose calls `choose`):

- `time`: the shortest iteration;
- `cost`: the lowest price per sample — the used devices' summed price per hour × the
  iteration time / the samples per iteration. A device a plan leaves idle costs nothing
  (you release it, or never rent it), so a slow cheap device is worth using exactly when the
  time it saves costs less than it does;
- `max_cost_per_hour`: the fastest plan whose used devices cost at most that per hour.

A fastest plan uses every device worth its communication; a cheaper or affordable one often
uses fewer. So the planner scores, beside the baselines, data parallelism over *prefixes* of
the device tiers (`subset_strategies`): tiers sorted by speed and, where every device has a
price, by price per sample; the most cost-efficient device alone. Each is named
'subset:4xA100-80GB+8xT4' in the candidates table.

Then the tolerance: candidates within `tolerance` of the best value are alike as far as the
cost model can tell (its measured median error, DEFAULT_TOLERANCE), so among them the planner
prefers fewer devices, then fewer stages (distinct placements), then one sync method, and the
plan's notes say so. Tolerance 0 keeps the best value.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from heterog.errors import PlanError
from heterog.fmt import human_time, human_usd
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import Objective, SyncMethod
from heterog.ir.plan import Plan
from heterog.search.baselines import dp_over
from heterog.search.lanes import Candidate, finalize
from heterog.search.problem import Problem, Strategy

# The cost model's median iteration-time error, measured on the H200 whole steps left out of
# the fit (45 steps of resnet50, bert-large, gpt2-medium: benchmarks/predict_gpu.py --fit-all,
# benchmarks/results/predict_gpu.json summary.h200.all.median_time_error = 0.0833;
# docs/cost_model.md "Accuracy"). Two plans closer than this are not told apart by it.
DEFAULT_TOLERANCE = 0.083
MAX_SUBSETS = 8  # device sets scored at most (a simulation or two each)
SUBSET_SHARE = 0.3  # of the time left for the lanes, at most, spent scoring them
SECONDS_PER_HOUR = 3600.0
SUBSET_PREFIX = "subset:"


@dataclass(frozen=True, kw_only=True, slots=True)
class Goal:
    """The objective, an optional ceiling on the used devices' price per hour, and the
    tolerance within which a simpler plan is preferred."""

    objective: Objective | str = Objective.TIME  # a string is checked and made an Objective
    max_cost_per_hour: float | None = None  # US dollars
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "objective", Objective(self.objective))
        except ValueError:
            raise PlanError(
                f"objective {self.objective!r} is not one of {', '.join(Objective)} (time: the shortest "
                f"iteration; cost: the lowest price per sample)."
            ) from None
        m = self.max_cost_per_hour
        if m is not None and not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
            raise PlanError(f"max_cost_per_hour must be a positive number of US dollars per hour, found {m!r}.")
        t = self.tolerance
        if not (isinstance(t, (int, float)) and 0.0 <= t < 1.0):
            raise PlanError(f"tolerance must be a fraction in [0, 1) (0.05 = 5 %; 0 keeps the best plan), found {t!r}.")

    @property
    def needs_prices(self) -> bool:
        return self.objective == Objective.COST or self.max_cost_per_hour is not None


# -- prices of plans ------------------------------------------------------------------------------


def usd_per_hour(cluster: Cluster, devices: Iterable[str]) -> float | None:
    """The summed price of `devices`; None when one has no price."""
    total = 0.0
    for d in devices:
        p = cluster.price_per_hour(d)
        if p is None:
            return None
        total += p
    return total


def cost_figures(cluster: Cluster, plan: Plan, iteration_time_s: float) -> dict[str, float]:
    """What one iteration of `plan` costs (Plan.predicted_cost): per hour of its used devices,
    per step, per million samples and, for a model with a sequence length, per million
    tokens; {} when a used device has no price."""
    hourly = usd_per_hour(cluster, plan.devices())
    if hourly is None:
        return {}
    step = hourly * iteration_time_s / SECONDS_PER_HOUR
    out = {
        "usd_per_hour": hourly,
        "usd_per_step": step,
        "usd_per_million_samples": step / plan.batch_size * 1e6,
    }
    if plan.model.seq_len:
        out["usd_per_million_tokens"] = step / (plan.batch_size * plan.model.seq_len) * 1e6
    return out


def check_priced(cluster: Cluster, goal: Goal) -> None:
    """A cost objective or a price ceiling needs every device's price: PlanError naming the
    unpriced types and how to give their prices, before any search."""
    if not goal.needs_prices:
        return
    unpriced: dict[str, int] = {}
    for d in cluster.devices:
        if cluster.price_per_hour(d.name) is None:
            unpriced[d.gpu_type] = unpriced.get(d.gpu_type, 0) + 1
    if unpriced:
        what = ", ".join(f"{t} ({n} device{'s' * (n > 1)})" for t, n in unpriced.items())
        example = ", ".join(f"{t}: 1.0" for t in unpriced)
        asked = "--objective cost" if goal.objective == Objective.COST else "--max-cost-per-hour"
        raise PlanError(
            f"{asked} needs a price per hour for every device, and cluster {cluster.name!r} has none for "
            f"{what}: the catalog lists no public price for them. Give their prices in US dollars per "
            f"device-hour: `--price TYPE=USD` (e.g. --price {next(iter(unpriced))}=1.0), or in the cluster "
            f"file `price_per_hour: {{{example}}}` (a node's or a device entry's `price_per_hour` too)."
        )


# -- more candidates: data parallelism on fewer devices -------------------------------------------


def subset_strategies(prob: Problem, cost_first: bool = False) -> Iterator[tuple[str, Strategy]]:
    """Data parallelism over the first k device tiers, k = 1, 2, …, the tiers sorted by speed
    and (every device priced) by price per sample; and the device cheapest per sample alone.
    Whole-cluster sets are left out (the baselines have them). Named by what they use; made
    one at a time (pricing a thousand devices' all-reduce takes a tenth of a second)."""
    time_s = prob.device_time_per_sample_s
    tiers = list(range(len(prob.tiers)))
    orders = [sorted(tiers, key=lambda t: (time_s[prob.tiers[t][0]], t))]
    prices = [prob.cluster.price_per_hour(prob.device_names[t[0]]) for t in prob.tiers]
    if all(p is not None for p in prices):
        per_sample = [p * time_s[t[0]] for p, t in zip(prices, prob.tiers)]
        orders.append(sorted(tiers, key=lambda t: (per_sample[t], t)))
    if cost_first:
        orders.reverse()
    sets: dict[tuple[int, ...], None] = {}
    for order in orders:
        sets.update((tuple(sorted(d for t in order[:k] for d in prob.tiers[t])), None) for k in range(1, len(order)))
    if len(orders) > 1:  # the device cheapest per sample, alone
        sets[(prob.tiers[orders[0 if cost_first else 1][0]][0],)] = None
    names: set[str] = set()
    for devs in list(sets)[:MAX_SUBSETS]:
        s = dp_over(prob, list(devs[: prob.batch_size]))
        if s is not None and (name := _subset_name(prob, s)) not in names:
            names.add(name)
            yield name, s


def _subset_name(prob: Problem, s: Strategy) -> str:
    counts: dict[str, int] = {}
    for d in s.placements[0].devices:
        dev = prob.cluster.device(prob.device_names[d])
        t = dev.gpu_type if dev.slowdown == 1.0 else f"{dev.gpu_type}/{dev.slowdown:g}x-slower"  # emulated
        counts[t] = counts.get(t, 0) + 1
    return SUBSET_PREFIX + "+".join(f"{n}x{t}" for t, n in counts.items())


def subset_candidates(
    prob: Problem, goal: Goal, deadline_s: float, known: Iterable[Strategy] = ()
) -> dict[str, Candidate]:
    """The subsets not in `known` (the baselines), each scored as the baselines are
    (lanes.finalize), one after the other until `deadline_s` (a perf_counter time): a few
    milliseconds each at tens of devices, a second at a thousand. For the cost objective the
    subsets cheapest per sample come first."""
    seen = {s.key() for s in known}
    out: dict[str, Candidate] = {}
    if time.perf_counter() >= deadline_s:
        return out
    for name, s in subset_strategies(prob, cost_first=goal.objective == Objective.COST):
        if s.key() not in seen:
            out[name] = finalize(prob, s, name)
        if time.perf_counter() >= deadline_s:
            break
    return out


# -- the choice ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    winner: Candidate
    candidates: tuple[Candidate, ...]  # every candidate, its plan's predicted_cost filled in
    notes: tuple[str, ...]  # why the winner, where the objective or the tolerance decided


def _devices(c: Candidate) -> str:
    n = len(c.plan.devices())
    return f"{n} device{'s' * (n != 1)}"


def _cost(c: Candidate) -> dict[str, float]:
    return c.plan.predicted_cost


def _stages(plan: Plan) -> int:
    return len({tuple(r.device for r in g.replicas) for g in plan.groups})


def _syncs(plan: Plan) -> int:
    return len({g.sync for g in plan.groups if len(g.replicas) > 1 and g.sync != SyncMethod.NONE})


def choose(prob: Problem, candidates: Sequence[Candidate], goal: Goal) -> Choice:
    """The winner among the feasible `candidates` (at least one) by `goal`, with the notes
    that say how the objective, the price ceiling and the tolerance decided."""
    priced = tuple(
        replace(c, plan=replace(c.plan, predicted_cost=cost_figures(prob.cluster, c.plan, c.iteration_time_s)))
        for c in candidates
    )
    order = {c.strategy: i for i, c in enumerate(priced)}
    pool = [c for c in priced if c.feasible]
    notes: list[str] = []
    if goal.max_cost_per_hour is not None:
        pool = _affordable(pool, goal.max_cost_per_hour, notes)
    value: Callable[[Candidate], float] = (
        (lambda c: _cost(c)["usd_per_step"]) if goal.objective == Objective.COST else (lambda c: c.iteration_time_s)
    )
    best = min(pool, key=lambda c: (value(c), order[c.strategy]))
    near = [c for c in pool if value(c) <= value(best) * (1 + goal.tolerance)]
    winner = min(
        near, key=lambda c: (len(c.plan.devices()), _stages(c.plan), _syncs(c.plan), value(c), order[c.strategy])
    )
    if winner is not best:
        notes.append(_tolerance_note(winner, best, value, goal))
    if goal.objective == Objective.COST:
        fastest = min((c for c in priced if c.feasible), key=lambda c: (c.iteration_time_s, order[c.strategy]))
        notes.append(_cost_note(winner, fastest))
    return Choice(winner=winner, candidates=priced, notes=tuple(notes))


def _affordable(pool: list[Candidate], ceiling: float, notes: list[str]) -> list[Candidate]:
    ok = [c for c in pool if _cost(c)["usd_per_hour"] <= ceiling * (1 + 1e-12)]
    cheapest = min(pool, key=lambda c: _cost(c)["usd_per_hour"])
    if not ok:
        raise PlanError(
            f"no plan found runs within --max-cost-per-hour ${ceiling:g}: the cheapest, {cheapest.strategy!r} on "
            f"{_devices(cheapest)}, costs {human_usd(_cost(cheapest)['usd_per_hour'])} per hour. "
            f"Raise the ceiling, or give the devices' real prices (`--price TYPE=USD`)."
        )
    fastest = min(pool, key=lambda c: c.iteration_time_s)
    if fastest not in ok:
        notes.append(
            f"within --max-cost-per-hour ${ceiling:g}: the fastest plan overall ({fastest.strategy!r}, "
            f"{human_time(fastest.iteration_time_s)} on {_devices(fastest)}) costs "
            f"{human_usd(_cost(fastest)['usd_per_hour'])} per hour, over the ceiling; the devices left idle cost "
            f"nothing."
        )
    return ok


def _tolerance_note(winner: Candidate, best: Candidate, value: Callable[[Candidate], float], goal: Goal) -> str:
    what = "cheapest" if goal.objective == Objective.COST else "fastest"
    gap = (value(winner) / value(best) - 1) * 100
    n_w, n_b = len(winner.plan.devices()), len(best.plan.devices())
    why = (
        "fewer devices"
        if n_w < n_b
        else "fewer stages"
        if _stages(winner.plan) < _stages(best.plan)
        else "one sync method"
        if _syncs(winner.plan) < _syncs(best.plan)
        else "a simpler plan"
    )
    return (
        f"a plan on {_devices(winner)} within {gap:.1f} % of the {what} ({best.strategy!r} on {_devices(best)}) was "
        f"chosen ({winner.strategy!r}): the tolerance is {goal.tolerance * 100:.1f} % (the cost model's median "
        f"error), so the gain is within its noise, and {why} is the simpler plan to run; --tolerance 0 keeps the "
        f"{what}."
    )


def _cost_note(winner: Candidate, fastest: Candidate) -> str:
    w, f = _cost(winner), _cost(fastest)
    line = (
        f"objective cost: {human_usd(w['usd_per_million_samples'])} per million samples "
        f"({human_usd(w['usd_per_hour'])} per hour for {_devices(winner)})"
    )
    if fastest is winner:
        return line + "; it is also the fastest plan."
    return line + (
        f"; the fastest plan, {fastest.strategy!r} ({human_time(fastest.iteration_time_s)}, "
        f"{_devices(fastest)}), costs {human_usd(f['usd_per_million_samples'])} per million samples "
        f"({f['usd_per_million_samples'] / w['usd_per_million_samples']:.2f}×) and is "
        f"{winner.iteration_time_s / fastest.iteration_time_s:.2f}× faster."
    )
