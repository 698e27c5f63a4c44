"""`heterog plan`'s objective options (--objective, --max-cost-per-hour, --tolerance, --price)
and how the candidates' costs print (search/objective.py decides; this reads the options)."""

from __future__ import annotations

import math
from typing import Any

import typer

from heterog.fmt import human_usd
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import Objective

OBJECTIVE_OPTION = typer.Option(
    "time",
    "--objective",
    help="time: the shortest iteration; cost: the lowest price per sample (the used devices' price per hour × "
    "iteration time / batch; idle devices cost nothing). Prices: the catalog's list prices, or --price.",
)
MAX_COST_OPTION = typer.Option(
    None,
    "--max-cost-per-hour",
    help="The fastest plan whose used devices cost at most this many US dollars per hour (may leave devices idle).",
)
TOLERANCE_OPTION = typer.Option(
    None,
    "--tolerance",
    help="Among plans within this fraction of the best (default 0.083: the cost model's median error), prefer "
    "fewer devices, then fewer stages, then one sync method; 0 keeps the best.",
)
PRICE_OPTION = typer.Option(
    None,
    "--price",
    help="TYPE=USD: what one device of TYPE costs per hour, over the catalog's list price (repeatable; a cluster "
    "file's price_per_hour does the same).",
)


def parse_prices(items: list[str] | None) -> dict[str, float]:
    """--price ['T4=0.35', 'A100-80GB=1.9'] → {'T4': 0.35, 'A100-80GB': 1.9}."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, raw = item.partition("=")
        try:
            usd = float(raw)
        except ValueError:
            usd = math.nan
        if not sep or not name.strip() or not (math.isfinite(usd) and usd >= 0):
            raise typer.BadParameter(
                f"{item!r}: write TYPE=USD, a GPU type and its price per device-hour in US dollars ≥ 0 "
                f"(e.g. --price T4=0.35).",
                param_hint="--price",
            )
        out[name.strip()] = usd
    return out


def objective_inputs(
    objective: str, max_cost_per_hour: float | None, tolerance: float | None, prices: list[str] | None, cluster: str
) -> tuple[Any, str | Cluster]:
    """(the planner's Goal, the cluster: its name, or loaded and priced when --price is given),
    checked before any search."""
    if objective not in tuple(Objective):
        raise typer.BadParameter(
            f"must be one of {', '.join(Objective)}, found {objective!r}.", param_hint="--objective"
        )
    # the search's modules (numpy) load only when the command runs
    from heterog.hardware.spec import load_cluster, with_prices
    from heterog.search.objective import DEFAULT_TOLERANCE, Goal, check_priced

    goal = Goal(
        objective=Objective(objective),
        max_cost_per_hour=max_cost_per_hour,
        tolerance=DEFAULT_TOLERANCE if tolerance is None else tolerance,
    )
    usd = parse_prices(prices)
    if not usd and not goal.needs_prices:
        return goal, cluster
    loaded = with_prices(load_cluster(cluster), usd) if usd else load_cluster(cluster)
    check_priced(loaded, goal)  # before the model is captured
    return goal, loaded


def cost_cells(c: dict[str, Any], per_tokens: bool) -> list[str]:
    """A candidate's cost columns: per hour of its used devices, per step, per million samples
    (or tokens); '—' where a used device has no price."""
    cost = c.get("cost") or {}
    if not cost:
        return ["—", "—", "—"]
    unit = "usd_per_million_tokens" if per_tokens else "usd_per_million_samples"
    return [human_usd(cost["usd_per_hour"]), human_usd(cost["usd_per_step"]), human_usd(cost[unit])]


def cost_headers(per_tokens: bool) -> list[str]:
    return ["$/hour", "$/step", f"$/M {'tokens' if per_tokens else 'samples'}"]


def cost_line(best: dict[str, Any]) -> str:
    """The chosen plan's cost for the summary line ('' when unpriced)."""
    cost = best.get("predicted_cost") or {}
    if not cost:
        return ""
    tokens = "usd_per_million_tokens" in cost
    per = cost["usd_per_million_tokens" if tokens else "usd_per_million_samples"]
    return f"; {human_usd(cost['usd_per_hour'])}/hour, {human_usd(per)} per million {'tokens' if tokens else 'samples'}"
