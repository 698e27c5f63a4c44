"""A stop request (SIGINT, SIGTERM) to the running command, kept in a module of its own.

`python -m heterog.cli.main` runs main.py as `__main__`; a command module that imported
heterog.cli.main would get a second copy of it, whose record no signal handler writes (the
handler installed is `__main__`'s), and a long search would miss the stop. Both copies
import this module, so there is one record.
"""

from __future__ import annotations

STOP_REQUESTED: list[int] = []   # signals that asked this command to stop


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
