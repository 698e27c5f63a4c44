"""heterog: plan and run fast training on clusters of unlike GPUs.

The stable Python API (same keys as the CLI's --json output):
capture, load_cluster, predict, plan, simulate, run, run_many. Imports are lazy so that the command
line starts fast and stages load only what they use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "capture": "heterog.capture",          # a callable package: heterog.capture(model, inputs)
    "load_cluster": "heterog.hardware.spec",
    "predict": "heterog.cost.predict",
    "simulate": "heterog.simulate",        # a callable package: heterog.simulate(graph, cluster, plan, costs)
    "plan": "heterog.plan_module",         # a name, a user file or an nn.Module (plan_module.py)
    "run": "heterog.pipeline",
    "run_many": "heterog.pipeline",
    "OpGraph": "heterog.ir.opgraph",
    "Plan": "heterog.ir.plan",
    "Cluster": "heterog.hardware.cluster",
    "HeterogError": "heterog.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        return module if module.__name__ == f"heterog.{name}" else getattr(module, name)
    raise AttributeError(f"module 'heterog' has no attribute {name!r}")
