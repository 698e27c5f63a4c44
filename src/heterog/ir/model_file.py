"""Portable user-model files: how a plan records the model file it was made for.

A user model is named 'path/file.py:factory', as typed when planning (the graph fingerprint is
computed from that name, so it is kept). A saved plan also records `file`, the model file's
path relative to the plan file, and its SHA-256; loading finds the file there and registers
it for the typed name (userfile.register_location), so `heterog simulate/run plan.json` work
from any folder, and on any node holding the file at the same place relative to the plan.
In memory (and in the spec the ranks get) `file` is absolute.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from heterog.errors import PlanError
from heterog.userfile import locate, register_location

if TYPE_CHECKING:  # ir/plan.py imports this module
    from heterog.ir.plan import ModelSpec


def user_model_file(name: str) -> tuple[str, str] | None:
    """(path, factory) of a user model name, None for a zoo name."""
    path, sep, attr = name.rpartition(":")
    return (path, attr) if sep and path.endswith(".py") else None


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def portable_model(model: ModelSpec, plan_dir: Path) -> ModelSpec:
    """The ModelSpec as a plan file in `plan_dir` records it."""
    user = user_model_file(model.name)
    if user is None:
        return model
    found = Path(model.file) if model.file else locate(user[0])
    if not found.is_file():
        raise PlanError(
            f"model file {str(found)!r} does not exist, so the plan cannot record it; save the "
            f"plan from the folder the model path is relative to."
        )
    rel = os.path.relpath(found.resolve(), plan_dir.resolve())
    return replace(model, file=rel, file_sha256=file_sha256(found))


def resolve_model(model: ModelSpec, plan_dir: Path, *, source: str) -> ModelSpec:
    """The ModelSpec of a loaded plan, its model file found next to the plan, checked against
    the recorded hash (missing or changed → PlanError saying what to do) and registered."""
    user = user_model_file(model.name)
    if user is None:
        return model
    if model.file is None:  # written before plans recorded the file: the name as typed
        return model
    found = Path(model.file) if os.path.isabs(model.file) else plan_dir / model.file
    if not found.is_file():
        raise PlanError(
            f"{source}: the plan's model file {model.file!r} (relative to the plan's folder "
            f"{plan_dir}) is missing; put the model file there — every node that runs the "
            f"plan needs it — or re-plan."
        )
    if model.file_sha256 is not None:
        now = file_sha256(found)
        if now != model.file_sha256:
            raise PlanError(
                f"{source}: the model file {found} changed since the plan was made "
                f"(sha256 {model.file_sha256[:12]}… then, {now[:12]}… now); the plan may not fit "
                f"the model any more. Re-plan, or restore the file the plan was made for."
            )
    register_location(user[0], found.resolve())
    return replace(model, file=str(found.resolve()))


def register_model_file(model: ModelSpec) -> None:
    """In a process that got the plan as a dict (a rank): open the model file the plan found."""
    user = user_model_file(model.name)
    if user is not None and model.file and os.path.isabs(model.file):
        register_location(user[0], Path(model.file))
