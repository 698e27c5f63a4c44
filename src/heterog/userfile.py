"""Load a user's Python file named as 'path/file.py:name' (models, data), once per process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from heterog.errors import ModelError


def load_user_module(path: str, *, what: str, spec: str) -> ModuleType:
    """Import `path` as a module (cached in sys.modules by its resolved path).

    `what` and `spec` name the user's argument in errors ("model 'x.py:f': ...").
    """
    file = Path(path)
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
