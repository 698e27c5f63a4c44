"""Prices in a cluster file: what a device costs per hour, where the catalog's list price
(catalog.yaml `price`) is not what you pay.

Three places, the most specific winning:

    price_per_hour: {T4: 0.35, A100-80GB: 1.9}   # top level: per device type, US dollars
    nodes:
      - name: p3
        price_per_hour: 12.24                     # a node: the whole node's price, split
        devices: [{type: V100-16GB, count: 4}]    #   evenly over its devices (a cloud instance)
      - name: lab
        devices:
          - {type: T4, count: 2, price_per_hour: 0}   # a device entry: each of its devices

A device a plan leaves idle costs nothing (search/objective.py); a node's price split over its
devices says what each used one costs. 0 is allowed (hardware you own and count as free).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from heterog.errors import ClusterError
from heterog.hardware import yamlfields as yf

FIELD = "price_per_hour"

# Anchors: public on-demand prices run from ~$0.1 (old consumer cards) to ~$10 per GPU-hour
# (B200); a figure far above is a node's or a month's price given for one device.
PRICE = yf.Plausible(
    what="price per device", unit="$/h", scale=1.0, error_low=0.0, warn_low=0.0, warn_high=100.0, error_high=10_000.0
)


def read_price(ctx: yf.Ctx, where: str, m: Any, devices: int = 1, key: str = FIELD) -> float:
    """The price m[key] (a node's, split over `devices`), checked: a finite number ≥ 0,
    plausible per device."""
    usd = yf.number(ctx, where, m, key, positive=False)
    yf.plausible(ctx, where, m, key, usd / devices, PRICE)
    return usd


def type_prices(ctx: yf.Ctx, doc: Any, resolve: Callable[[str], str]) -> dict[str, float]:
    """The top-level `price_per_hour: {TYPE: usd}` by canonical type name (`resolve` turns a
    spelling into it, raising ClusterError for an unknown type)."""
    if FIELD not in doc:
        return {}
    m = doc[FIELD]
    if not isinstance(m, dict) or not m:
        raise ctx.fail(
            "",
            doc,
            FIELD,
            f"expected a mapping of GPU type → US dollars per device-hour (e.g. {{T4: 0.35}}), found {m!r}; "
            f"a node's price goes on the node.",
        )
    out: dict[str, float] = {}
    for name in m:
        try:
            canon = resolve(str(name))
        except ClusterError as e:
            raise ctx.fail(FIELD, m, name, str(e)) from None
        out[canon] = read_price(ctx, FIELD, m, key=name)
    return out


def check_types_used(ctx: yf.Ctx, doc: Any, priced: dict[str, float], used: set[str]) -> None:
    """A type priced at the top level that no device has is a slip (a misspelt or wrong type)."""
    extra = sorted(set(priced) - used)
    if extra:
        raise ctx.fail(
            "",
            doc,
            FIELD,
            f"prices type(s) {', '.join(extra)}, which no device of this cluster has (its types: "
            f"{', '.join(sorted(used))}); fix the type name or remove the entry.",
        )
