"""Stage packages that are also their stage's main function.

DESIGN.md's API is `heterog.capture(model, inputs)` and `heterog.simulate(graph, ...)`, while
`heterog.capture` and `heterog.simulate` are also packages (capture.zoo, simulate.priorities).
Once a package is imported, Python binds its name on the parent to the module, which would
shadow the function; making the package callable keeps both spellings working.
"""

from __future__ import annotations

import types


class CallablePackage(types.ModuleType):
    """heterog.X(...) calls heterog.X.X(...)."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)
