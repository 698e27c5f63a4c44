"""numba's `njit` where numba can be imported, else the plain Python function: the one place
that decides whether the simulator's loops run compiled.

numba accelerates the list scheduler (lower/order.py), the timed pass and the memory replay
(simulate/engine.py, lower/taskgraph.py), which the search runs for every neighbour it
scores; it does not change their results. The same source runs under CPython on the same
numpy arrays (IEEE doubles, int64), so the orders, times and memory timelines are equal
bit for bit (tests/test_no_numba.py compares them). Where numba is missing — a machine handed
its wheels without llvmlite, a Python release numba does not support yet — heterog still
runs, and says once on stderr that the simulator is uncompiled and how much slower it is.

HETEROG_NO_NUMBA=1 forces the fallback (tests, `benchmarks/simulator_speed.py --no-numba`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

NO_NUMBA_ENV = "HETEROG_NO_NUMBA"

# Uncompiled ÷ compiled CPU time of simulating a neighbour plan (the search's case): median
# and range over benchmarks/simulator_speed.py's nine plans (128 to 59 442 tasks), from three
# runs of `python benchmarks/simulator_speed.py --no-numba` on a shared 2-core machine: medians
# 8.3× (benchmarks/results/simulator_speed_no_numba.json), 8.7× and 10.7×; ranges 3.5–37.3×,
# 4.2–39.3× and 5.0–38.2×.
SLOWDOWN_MEDIAN = 9
SLOWDOWN_RANGE = (4, 39)


def _load_numba() -> tuple[Any, str, str]:
    """(the numba module or None, why it is not used, what brings it back)."""
    if os.environ.get(NO_NUMBA_ENV, "").strip() not in ("", "0"):
        return None, f"{NO_NUMBA_ENV} is set", f"unset {NO_NUMBA_ENV}"
    try:
        import numba
    except ImportError as e:  # not installed, or built for another Python or numpy
        return None, f"numba cannot be imported ({e})", "install numba (pip install numba)"
    return numba, "", ""


_numba, WHY_UNCOMPILED, _REMEDY = _load_numba()
COMPILED = _numba is not None
_said = False


def say_uncompiled_once() -> None:
    """Tell the user, once per process, that the simulator runs as plain Python."""
    global _said
    if COMPILED or _said:
        return
    _said = True
    low, high = SLOWDOWN_RANGE
    print(
        f"warning: {WHY_UNCOMPILED}: heterog's simulator runs as plain Python, with the same results, "
        f"about {SLOWDOWN_MEDIAN}× slower per simulated plan ({low}–{high}× on its benchmark's plans); a plan "
        f"search, which scores thousands, feels it most. To run it compiled, {_REMEDY}.",
        file=sys.stderr,
        flush=True,
    )


def njit(**options: Any) -> Callable[[Callable], Callable]:
    """numba.njit(**options) when numba is used. Otherwise the function itself: an entry point
    (one the Python side calls) first says that it runs uncompiled; a helper that compiled code
    inlines (inline="always") is returned as it is, since it is called per task."""

    def wrap(fn: Callable) -> Callable:
        if COMPILED:
            return _numba.njit(**options)(fn)
        if options.get("inline") == "always":
            return fn

        @functools.wraps(fn)
        def uncompiled(*args: Any, **kwargs: Any) -> Any:
            say_uncompiled_once()
            return fn(*args, **kwargs)

        return uncompiled

    return wrap
