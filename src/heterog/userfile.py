"""Load a user's Python file named as 'path/file.py:name' (models, data), once per process.

A plan names its model file as it was typed when planning (the graph fingerprint is computed
from that name) and records where the file lies relative to the plan file. When a plan is
loaded from another folder or node, ir/plan.py finds the file next to the plan and registers
that location here (`register_location`), so every loader below opens the right file under
the name the plan uses. The registry only ever maps a typed path to a checked file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from heterog.errors import ModelError

_LOCATIONS: dict[str, Path] = {}  # path as a plan names it → the file found for that plan


def register_location(path: str, file: Path) -> None:
    """Open `file` whenever `path` is asked for in this process (see the module docstring)."""
    _LOCATIONS[path] = file


def locate(path: str) -> Path:
    """The file a user path names: the registered location, else the path itself."""
    return _LOCATIONS.get(path, Path(path))


def load_user_module(path: str, *, what: str, spec: str) -> ModuleType:
    """Import `path` as a module (cached in sys.modules by its resolved path).

    `what` and `spec` name the user's argument in errors ("model 'x.py:f': ...").
    """
    file = locate(path)
    if not file.is_file():
        raise ModelError(f"{what} {spec!r}: no file {path!r}; give 'path/file.py:name'.")
    mod_name = f"heterog_user_{abs(hash(str(file.resolve())))}"
    module = sys.modules.get(mod_name)
    if module is None:
        ispec = importlib.util.spec_from_file_location(mod_name, file)
        if ispec is None or ispec.loader is None:
            raise ModelError(f"{what} {spec!r}: {path} is not a Python file that can be imported.")
        module = importlib.util.module_from_spec(ispec)
        try:
            ispec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's code; report it, keep the cause
            raise ModelError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}.") from e
        sys.modules[mod_name] = module
    return module
