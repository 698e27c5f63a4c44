"""Costs: time of every node on every device type, memory, and communication.

`build_cost_model(graph, cluster, ...)` returns the analytic roofline model (cost.analytic),
which implements the CostModel protocol (cost.model) the simulator and the search call.
`heterog.cost.predict.predict(...)` is one training step on one device type.
"""

from __future__ import annotations

from pathlib import Path

from heterog.cost.analytic import AnalyticCostModel
from heterog.cost.model import CostModel
from heterog.cost.profile import Profile, ProfileError
from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph

__all__ = ["AnalyticCostModel", "CostModel", "Profile", "ProfileError", "build_cost_model"]


def build_cost_model(
    graph: OpGraph,
    cluster: Cluster,
    *,
    precision: str = "fp32",
    optimizer: str = "sgd",
    profile: Profile | str | Path | None = None,
    recompute: bool = False,
) -> AnalyticCostModel:
    """The cost model for `graph` on `cluster`; `profile` (a Profile or its file) overrides
    the analytic time of every node it measured."""
    if profile is not None and not isinstance(profile, Profile):
        profile = Profile.load(profile)
    return AnalyticCostModel(
        graph, cluster, precision=precision, optimizer=optimizer, profile=profile, recompute=recompute
    )
