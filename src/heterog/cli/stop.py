"""A stop request (SIGINT, SIGTERM) to the running command, kept in a module of its own.

`python -m heterog.cli.main` runs main.py as `__main__`; a command module that imported
heterog.cli.main would get a second copy of it, whose record no signal handler writes (the
handler installed is `__main__`'s), and a long search would miss the stop. Both copies
import this module, so there is one record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

STOP_REQUESTED: list[int] = []  # signals that asked this command to stop


def interrupt(signum, frame) -> None:
    """SIGINT / SIGTERM: raise KeyboardInterrupt, and remember it — Python drops an exception
    raised while a weakref callback or __del__ runs (torch's WeakIdKeyDictionary callbacks
    run in every garbage collection), so a long command checks `raise_if_stopped`."""
    STOP_REQUESTED.append(signum)
    raise KeyboardInterrupt


def raise_if_stopped() -> None:
    """KeyboardInterrupt if a stop signal arrived (for the callbacks of long-running work)."""
    if STOP_REQUESTED:
        raise KeyboardInterrupt


def quiet_unraisable(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """A sys.unraisablehook that drops the KeyboardInterrupt of a stop already recorded (the
    one `interrupt` raised inside a weakref callback: Python would print it as "Exception
    ignored in …" with a traceback, although the command stops cleanly at its next
    `raise_if_stopped`) and passes everything else to `previous`."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and STOP_REQUESTED:
            return
        previous(unraisable)

    return hook
