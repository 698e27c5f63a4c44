"""The iteration simulator: a Plan on a cluster → SimResult (time, memory, timeline)."""

from heterog.simulate.priorities import assign_priorities, node_ranks
from heterog.simulate.result import SimResult
from heterog.simulate.simulator import simulate

__all__ = ["simulate", "SimResult", "assign_priorities", "node_ranks"]

# heterog.simulate(...) is the API's simulate (a plan, or graph, cluster, plan and costs), even
# after the package is imported (see heterog/_callable.py)
import sys as _sys  # noqa: E402

from heterog._callable import CallablePackage as _CallablePackage  # noqa: E402

_sys.modules[__name__].__class__ = _CallablePackage
