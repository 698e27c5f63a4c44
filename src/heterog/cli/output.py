"""Shared output helpers: JSON for machines, rich tables for people, atomic files."""

from __future__ import annotations

import ast
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from heterog.errors import ModelError
from heterog.jsonio import write_atomic

console = Console()


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def print_json(data: Any) -> None:
    """Exactly one JSON document on stdout (no progress bars or colour)."""
    print(json.dumps(_clean(data), indent=1))


def write_json(path: str, data: Any) -> None:
    write_atomic(path, json.dumps(_clean(data), indent=1) + "\n")


_options = {"wide": False}
WIDE_HELP = "Print every table column, however wide (tables otherwise fit the terminal)."
NO_WRAP_CHARS = 24  # a cell up to this long is one unit (a number with its unit, a device name)
BORDER_CHARS = 3  # what each column adds in rich's boxed table: "│ " … " "
NUMERIC = re.compile(r"^[-+−]?(\d[\d,.]*|—|-)(\s?\S{0,14})?$")


def set_wide(wide: bool) -> None:
    """--wide: tables take the width they need instead of fitting the terminal."""
    _options["wide"] = wide


@dataclass(frozen=True, kw_only=True, slots=True)
class _Column:
    header: str
    min_width: int  # never narrower: no cell is cut, only text wrapped at spaces
    width: int  # what it takes on one line
    numeric: bool


def _columns(columns: Sequence[str], cells: list[list[str]]) -> list[_Column]:
    out = []
    for i, h in enumerate(columns):
        col = [r[i] for r in cells]
        words = [w for c in (h, *col) for w in c.split()] or [""]
        numeric = bool(col) and all(NUMERIC.match(c) for c in col if c)
        # a number keeps its unit on its line; text wraps at spaces, never inside a word
        unit = max((len(c) for c in col if len(c) <= NO_WRAP_CHARS), default=0) if numeric else 0
        out.append(
            _Column(
                header=h,
                min_width=max(unit, *(len(w) for w in words)),
                width=max(len(h), *(len(c) for c in col)) if col else len(h),
                numeric=numeric,
            )
        )
    return out


def _fit(cols: list[_Column], available: int) -> list[int] | None:
    """Widths that fit `available` characters, narrowing the widest wrappable column one
    character at a time (so text wraps, numbers and names never do); None if impossible."""
    widths = [c.width for c in cols]
    budget = available - BORDER_CHARS * len(cols) - 1
    while sum(widths) > budget:
        shrink = [i for i, c in enumerate(cols) if widths[i] > c.min_width]
        if not shrink:
            return None
        i = max(shrink, key=lambda i: widths[i])
        widths[i] -= 1
    return widths


def table_width() -> int:
    """The terminal's width: $COLUMNS when set (read at each call, so tests can set it)."""
    env = os.environ.get("COLUMNS", "")
    return int(env) if env.isdigit() else console.width


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], optional: Sequence[str] = ()
) -> None:
    """A table that fits the terminal without cutting a cell: long text wraps at spaces; if that
    is not enough, the `optional` columns are left out (named below the table; --wide shows
    them). A table that still cannot fit is printed wider rather than cut."""
    cells = [[str(x) for x in r] for r in rows]
    keep = list(range(len(columns)))
    available = 10**6 if _options["wide"] else table_width()
    cols = _columns(columns, cells)
    widths = _fit(cols, available)
    dropped: list[str] = []
    for name in optional:  # left out in the order given
        if widths is not None or name not in columns:
            continue
        keep.remove(columns.index(name))
        dropped.append(name)
        cols = _columns([columns[i] for i in keep], [[r[i] for i in keep] for r in cells])
        widths = _fit(cols, available)
    if widths is None:
        widths = [c.min_width for c in cols]
    table = Table(title=title, title_justify="left")
    for c, w in zip(cols, widths):
        table.add_column(
            c.header,
            justify="right" if c.numeric and c is not cols[0] else "left",
            width=w,
            no_wrap=w >= c.width,
            overflow="fold",
        )
    for r in cells:
        table.add_row(*[r[i] for i in keep])
    need = sum(widths) + BORDER_CHARS * len(widths) + 1
    Console(width=max(need, min(available, need + 40)), file=console.file).print(table)
    if dropped:
        console.print(f"[dim](not shown: {', '.join(dropped)}; --wide shows every column)[/dim]")


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """--model-arg ['depth=12', 'dropout=0.1', 'name=x'] → {'depth': 12, 'dropout': 0.1, 'name': 'x'}
    (Python literals or true/false/none where they parse, else the string)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ModelError(f"--model-arg {item!r}: write it as key=value, e.g. --model-arg layers=4.")
        raw = raw.strip()
        words = {"true": True, "false": False, "none": None, "null": None}
        try:
            out[key.strip()] = words[raw.lower()] if raw.lower() in words else ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key.strip()] = raw
    return out
