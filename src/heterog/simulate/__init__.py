"""The iteration simulator: a Plan on a cluster → SimResult (time, memory, timeline)."""

from heterog.simulate.priorities import assign_priorities, node_ranks
from heterog.simulate.result import SimResult
from heterog.simulate.simulator import simulate

__all__ = ["simulate", "SimResult", "assign_priorities", "node_ranks"]
