"""Hold SIGINT and SIGTERM while a block runs, then deliver them: for work that must not be
interrupted halfway (a torch callback, an import that runs generated code)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them. A KeyboardInterrupt
    raised inside code that C calls back into may not unwind (torch's dispatcher aborts the
    process), and one that leaves code CPython runs from a string marks the interpreter, which
    then ends by SIGINT whatever exit code the program chose. The blocks last seconds."""
    held: list[int] = []
    try:
        old = {s: signal.signal(s, lambda num, _frame: held.append(num)) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for num in dict.fromkeys(held):
            signal.raise_signal(num)
