"""Shared output helpers: JSON for machines, rich tables for people, atomic files."""

from __future__ import annotations

import ast
import json
import math
from typing import Any, Sequence

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


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*[str(x) for x in r])
    console.print(table)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def human_flops(f: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= size:
            return f"{f / size:.2f} {unit}"
    return f"{f:.0f} FLOP"


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
