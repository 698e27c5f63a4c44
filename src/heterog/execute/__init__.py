"""Carry out a Plan on torch.distributed: `run(plan, steps=...)` (see api.py)."""

from heterog.execute.api import run

__all__ = ["run"]
