"""What the lowering does with a tensor-parallel plan: refuse it, saying why and what works.

A tensor-parallel replica's members each run their slice of the group's blocks, with the
per-block all-reduces between them (cost/tensor_parallel.py). The simulator prices such a
plan on its first ranks (simulate/tensor_parallel.py); a Program needs every member's own
instructions and modules split Megatron-style, which the executor does not build yet. The
schedule would otherwise drop the members silently and run the whole blocks on first ranks.
"""

from __future__ import annotations

from heterog.errors import PlanError
from heterog.ir.plan import Plan


def executor_runs_tensor_parallel() -> bool:
    """Whether the executor runs tensor-parallel plans: the one switch that planning for a run
    (the demo, an elastic run's re-plans, benchmarks/run_vs_sim.py) consults, so that it never
    chooses a plan this module refuses. False until the executor splits modules."""
    return False


def refuse_tensor_parallel(plan: Plan, what: str) -> Plan:
    """`plan`, or a PlanError when it splits a group by tensor parallelism: `what` cannot use it."""
    if not plan.tensor_parallel:
        return plan
    split = ", ".join(f"{g.name} (tp {g.tp_degree})" for g in plan.groups if g.tp_degree > 1)
    raise PlanError(
        f"the plan splits groups by tensor parallelism ({split}), and {what} cannot use it yet: the "
        f"executor does not split modules Megatron-style, so no Program is written for the members. "
        f"`heterog simulate` and `heterog report` price and show it; to run, plan with --tp 1 (or a "
        f"strategy without tensor parallelism)."
    )
