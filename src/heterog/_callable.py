"""Stage packages that are also their stage's main function.

The API spells `heterog.capture(model, inputs)`, `heterog.simulate(plan)` and
`heterog.lower(plan)`, while `heterog.capture`, `heterog.simulate` and `heterog.lower` are
also packages (capture.zoo, simulate.priorities, lower.blocks). Once a package is imported,
Python binds its name on the parent to the module, which would shadow the function; a
callable package keeps both spellings working, in a fresh interpreter and after any import.
"""

from __future__ import annotations

import types

from heterog import api_function


class CallablePackage(types.ModuleType):
    """heterog.X(...) calls the function the API names X (heterog/__init__.py: api_function).

    A package may also name functions that share a name with one of its submodules
    (heterog.capture.capture, the function, and capture/capture.py): importing that submodule
    must not rebind the name on the package, so such names are listed in `_FUNCTIONS`."""

    def __call__(self, *args, **kwargs):
        return api_function(self.__name__.rpartition(".")[2])(*args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_FUNCTIONS", ()):
            return  # the import system binding a submodule over one of the package's functions
        super().__setattr__(name, value)
