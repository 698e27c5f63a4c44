"""What-if: how a model's iteration would change with k more (or fewer) devices of a type.

HeteroG's observation is that adding weak GPUs to plain data parallelism can make training
slower: the slowest replica sets the pace and the smallest memory the batch. So the answer to
"would 4 more T4s help?" depends on how the cluster is used. For each change this plans the
model on the changed cluster (the planner's best plan, as `heterog plan` finds it) and reads
beside it even data parallelism on all its devices (what a user without heterog runs), both
relative to the unchanged cluster.

Added devices form a new node of their type. By default it is connected as the base
cluster's best-connected node is (its NIC bandwidth and latency); `nic_gbps` says otherwise,
and a pool file (a cluster YAML) offers the nodes devices are taken from instead. Removed
devices are taken from the nodes holding most of their type, last devices first; a node left
empty goes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterog.errors import ClusterError, PlanError, did_you_mean
from heterog.hardware.catalog import get_gpu
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import _gpu_type_to_dict, cluster_from_dict, cluster_to_dict, load_cluster
from heterog.ir.plan import Plan
from heterog.plan_module import plan
from heterog.search.objective import Goal

EVEN_DP = "even-dp-allreduce"


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    """`count` devices of `gpu_type` added (count > 0) or removed (count < 0)."""

    gpu_type: str
    count: int

    def __post_init__(self) -> None:
        if self.count == 0:
            raise PlanError(f"a change of 0 {self.gpu_type} devices changes nothing; give a count of at least 1.")

    @property
    def label(self) -> str:
        return f"{'+' if self.count > 0 else '-'}{abs(self.count)} {self.gpu_type}"


def parse_changes(text: str | None, *, remove: bool = False) -> list[Change]:
    """'T4:4,V100-16GB:2' → changes (negative counts with remove). A missing count is 1."""
    out: list[Change] = []
    flag = "--remove" if remove else "--add"
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        gpu_type, _, count = item.partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise PlanError(
                f"{flag} {item!r}: the count after ':' must be a whole number, e.g. {gpu_type}:4."
            ) from None
        if n < 1:
            raise PlanError(f"{flag} {item!r}: the count must be at least 1.")
        out.append(Change(gpu_type=gpu_type.strip(), count=-n if remove else n))
    return out


def _canonical_type(doc: dict[str, Any], gpu_type: str) -> str:
    """The type's name as the cluster or the catalog spells it, added to `doc` if new."""
    if gpu_type in doc["gpu_types"]:
        return gpu_type
    try:
        gpu = get_gpu(gpu_type)
    except ClusterError as e:
        raise PlanError(f"--add {gpu_type}: {e}") from None
    doc["gpu_types"].setdefault(gpu.name, _gpu_type_to_dict(gpu))
    return gpu.name


def _add(doc: dict[str, Any], change: Change, pool: Cluster | None, nic_gbps: float | None) -> None:
    if pool is not None:
        _add_from_pool(doc, change, pool)
        return
    gpu_type = _canonical_type(doc, change.gpu_type)
    best = max(doc["nodes"], key=lambda n: n["nic_bandwidth_bytes_per_s"])
    name = f"added-{gpu_type}"
    doc["nodes"].append(
        {
            "name": name,
            "nic_bandwidth_bytes_per_s": nic_gbps * 1e9 / 8 if nic_gbps else best["nic_bandwidth_bytes_per_s"],
            "nic_latency_s": best["nic_latency_s"],
            "intra_latency_s": best["intra_latency_s"],
            "devices": [{"name": f"{name}/gpu{i}", "type": gpu_type} for i in range(change.count)],
        }
    )


def _add_from_pool(doc: dict[str, Any], change: Change, pool: Cluster) -> None:
    """Take `change.count` devices of its type from the pool's nodes, in the pool's order."""
    pool_doc = cluster_to_dict(pool)
    left = change.count
    for node in pool_doc["nodes"]:
        picked = [d for d in node["devices"] if d["type"] == change.gpu_type][:left]
        if not picked:
            continue
        doc["gpu_types"].setdefault(change.gpu_type, pool_doc["gpu_types"][change.gpu_type])
        name = f"pool-{node['name']}"
        doc["nodes"].append(
            {
                **{k: v for k, v in node.items() if k not in ("name", "devices")},
                "name": name,
                "devices": [{**d, "name": f"{name}/gpu{i}"} for i, d in enumerate(picked)],
            }
        )
        left -= len(picked)
        if left == 0:
            return
    raise PlanError(
        f"--add {change.gpu_type}:{change.count}: the pool {pool.name!r} holds only {change.count - left} "
        f"{change.gpu_type} device(s); add fewer or give a larger pool."
    )


def _remove(doc: dict[str, Any], change: Change) -> None:
    have = sum(d["type"] == change.gpu_type for n in doc["nodes"] for d in n["devices"])
    if have < -change.count:
        hint = did_you_mean(change.gpu_type, list(doc["gpu_types"])) if not have else ""
        raise PlanError(
            f"--remove {change.gpu_type}:{-change.count}: the cluster has {have} {change.gpu_type} device(s).{hint} "
            f"Its types: {', '.join(doc['gpu_types'])}."
        )
    left = -change.count
    while left:
        node = max(doc["nodes"], key=lambda n: sum(d["type"] == change.gpu_type for d in n["devices"]))
        idx = max(i for i, d in enumerate(node["devices"]) if d["type"] == change.gpu_type)
        del node["devices"][idx]
        left -= 1
    doc["nodes"] = [n for n in doc["nodes"] if n["devices"]]
    if not doc["nodes"]:
        raise PlanError(f"--remove {change.gpu_type}:{-change.count} leaves no device to train on.")


def changed_cluster(
    base: Cluster, changes: list[Change], *, pool: Cluster | None = None, nic_gbps: float | None = None
) -> Cluster:
    """`base` with every change applied in order."""
    doc = copy.deepcopy(cluster_to_dict(base))
    for change in changes:
        (_add(doc, change, pool, nic_gbps) if change.count > 0 else _remove(doc, change))
    doc["name"] = f"{base.name} {' '.join(c.label for c in changes)}"
    return cluster_from_dict(doc)


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    """One cluster: heterog's best plan on it and even data parallelism over all its devices."""

    changes: tuple[Change, ...]
    devices: int
    plan_time_s: float | None  # None: no plan fits
    plan_strategy: str
    plan_devices_used: int
    even_dp_time_s: float | None  # None: even DP does not fit
    plan: dict[str, Any] = field(repr=False)

    @property
    def plan_cost(self) -> dict[str, float]:
        """What heterog's plan costs (search/objective.py cost_figures): per hour of its used
        devices, per step, per million samples; {} where a used device has no price."""
        return dict(self.plan.get("predicted_cost") or {})

    @property
    def label(self) -> str:
        return " ".join(c.label for c in self.changes) or "(as is)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": [{"gpu_type": c.gpu_type, "count": c.count} for c in self.changes],
            "label": self.label,
            "devices": self.devices,
            "plan_time_s": self.plan_time_s,
            "plan_strategy": self.plan_strategy,
            "plan_devices_used": self.plan_devices_used,
            "even_dp_time_s": self.even_dp_time_s,
            "plan_cost": self.plan_cost,
            "plan": self.plan,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class WhatIf:
    model: str
    batch_size: int
    cluster: str
    base: Scenario
    scenarios: tuple[Scenario, ...]  # ranked: fastest heterog plan first

    def speedup(self, s: Scenario, key: str) -> float | None:
        """How much faster than the unchanged cluster (above 1: faster), by heterog's plan
        ('plan') or even DP ('even_dp')."""
        then, now = getattr(self.base, f"{key}_time_s"), getattr(s, f"{key}_time_s")
        return None if then is None or now is None else then / now

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "heterog.WhatIf",
            "model": self.model,
            "batch_size": self.batch_size,
            "cluster": self.cluster,
            "base": self.base.to_dict(),
            "scenarios": [
                {**s.to_dict(), "plan_speedup": self.speedup(s, "plan"), "even_dp_speedup": self.speedup(s, "even_dp")}
                for s in self.scenarios
            ],
        }


def _scenario(changes: tuple[Change, ...], cluster: Cluster, plan_kw: dict[str, Any]) -> Scenario:
    result = plan(cluster=cluster, **plan_kw)
    best = result["best"]
    feasible = [c for c in result["candidates"] if c["feasible"]]
    even = next((c for c in result["candidates"] if c["strategy"] == EVEN_DP), None)
    return Scenario(
        changes=changes,
        devices=len(cluster.devices),
        plan_time_s=best["predicted_iteration_time_s"] if feasible else None,
        plan_strategy=best["strategy"],
        plan_devices_used=len(Plan.from_dict(best).devices()),
        even_dp_time_s=even["iteration_time_s"] if even is not None and even["feasible"] else None,
        plan=best,
    )


def whatif(
    model: str,
    *,
    batch_size: int,
    cluster: str | Path | Cluster,
    add: list[Change] | str | None = None,
    remove: list[Change] | str | None = None,
    together: bool = False,
    pool: str | Path | Cluster | None = None,
    nic_gbps: float | None = None,
    **plan_options: Any,
) -> WhatIf:
    """The unchanged cluster and each change (or, with `together`, all of them at once),
    planned with heterog.plan's options (budget_s, seed, max_iters, precision, optimizer,
    seq_len, model_args, …); scenarios ranked by heterog's predicted iteration time."""
    base = cluster if isinstance(cluster, Cluster) else load_cluster(str(cluster))
    pool_cluster = pool if pool is None or isinstance(pool, Cluster) else load_cluster(str(pool))
    changes = [
        *(parse_changes(add) if isinstance(add, str) or add is None else add),
        *(parse_changes(remove, remove=True) if isinstance(remove, str) or remove is None else remove),
    ]
    if not changes:
        raise PlanError("no change to weigh: give --add TYPE:COUNT and/or --remove TYPE:COUNT.")
    groups = [tuple(changes)] if together else [(c,) for c in changes]
    clusters = [changed_cluster(base, list(g), pool=pool_cluster, nic_gbps=nic_gbps) for g in groups]
    # the fastest plan each cluster allows (no tolerance for simpler plans): what-if weighs time
    plan_kw = {"model": model, "batch_size": batch_size, "goal": Goal(tolerance=0.0), **plan_options}
    first = _scenario((), base, plan_kw)
    rest = [_scenario(g, c, plan_kw) for g, c in zip(groups, clusters)]
    rest.sort(key=lambda s: (s.plan_time_s is None, s.plan_time_s or 0.0))
    return WhatIf(model=model, batch_size=batch_size, cluster=base.name, base=first, scenarios=tuple(rest))
