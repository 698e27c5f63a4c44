"""Measured profiles applied to a cluster, per device type (`heterog plan --profile FILE[:TYPE]`).

A profile file is either per-node times (heterog.Profile) or a device profile
(heterog.DeviceProfile, what `heterog profile` writes). Each applies to the devices of one
type of the cluster: the type it was measured on, or the TYPE named after the file — so a
profile taken on one A100 serves every A100-80GB of a mixed cluster, and one taken on this
CPU can stand for a calibrated CPU type. Per-node times replace the analytic estimate of the
nodes they measured; a device profile of a GPU also calibrates its type for the plan
(cost/calibrate.py: compute factors from its GEMMs, memory from its copy, host costs), so the
nodes it did not measure are costed as that machine runs them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from heterog.cost.calibrate import calibrate
from heterog.cost.device_profile import DeviceProfile
from heterog.cost.profile import Profile, ProfileError
from heterog.hardware.catalog import gpu_from_entry
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import with_gpu_type


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSpec:
    path: Path
    gpu_type: str | None = None  # the cluster type it stands for; None: the measured type

    @staticmethod
    def parse(text: str | Path) -> ProfileSpec:
        """'FILE' or 'FILE:TYPE' (a FILE that exists is taken whole, colons and all)."""
        raw = str(text)
        if Path(raw).exists() or ":" not in raw:
            return ProfileSpec(path=Path(raw))
        path, _, gpu_type = raw.rpartition(":")
        return ProfileSpec(path=Path(path), gpu_type=gpu_type or None)


def _load(path: Path):
    try:
        kind = json.loads(path.read_text()).get("kind")
    except OSError as e:
        raise ProfileError(f"--profile {path}: cannot be read ({e.strerror}).") from None
    except (ValueError, AttributeError):
        kind = None
    return DeviceProfile.load(path) if kind == "heterog.DeviceProfile" else Profile.load(path)


def _retyped(times: dict, target: str, where: str) -> dict:
    measured = {t for by_type in times.values() for t in by_type}
    if len(measured) > 1:
        raise ProfileError(
            f"{where} holds times of several device types ({', '.join(sorted(measured))}); "
            f"it cannot stand for one type {target!r}."
        )
    # at most one type (checked above): each node's phases, under the target type
    return {node: {target: phases} for node, by_type in times.items() for phases in by_type.values()}


def apply_profiles(cluster: Cluster, specs: list[ProfileSpec | str | Path] | Any) -> tuple[Cluster, Profile | None]:
    """The cluster with every profiled GPU type calibrated, and the per-node times of all the
    profiles merged (None if none measured nodes)."""
    if specs is None:
        return cluster, None
    if isinstance(specs, (str, Path, Profile, DeviceProfile, ProfileSpec)):
        specs = [specs]
    times: dict = {}
    model = ""
    for spec in specs:
        if isinstance(spec, (Profile, DeviceProfile)):
            prof, target, where = spec, None, "the profile"
        else:
            spec = spec if isinstance(spec, ProfileSpec) else ProfileSpec.parse(spec)
            prof, target, where = _load(spec.path), spec.gpu_type, f"--profile {spec.path}"
        if isinstance(prof, DeviceProfile):
            measured = target or prof.device_type
            if measured not in cluster.gpu_types:
                raise ProfileError(
                    f"{where} was measured on a {prof.device_type!r} device, and cluster "
                    f"{cluster.name!r} has no device of type {measured!r}; name the type it "
                    f"stands for: --profile {where.split()[-1]}:TYPE (types: "
                    f"{', '.join(cluster.gpu_types)})."
                )
            if cluster.gpu_types[measured].vendor != "cpu" and (prof.gemm or prof.copy or prof.host):
                cluster = with_gpu_type(
                    cluster,
                    gpu_from_entry(
                        calibrate(
                            prof, name=measured, base=prof.device_type if prof.device_type != "cpu" else measured
                        ),
                        f"{where} (calibrated)",
                    ),
                )
        node_prof = prof.nodes if isinstance(prof, DeviceProfile) else prof
        if node_prof is None:
            continue
        node_times = _retyped(node_prof.times, target, where) if target else node_prof.times
        unknown = {t for by_type in node_times.values() for t in by_type} - set(cluster.gpu_types)
        if unknown:
            raise ProfileError(
                f"{where} holds times of device type(s) {', '.join(sorted(unknown))}, which cluster "
                f"{cluster.name!r} does not have ({', '.join(cluster.gpu_types)}); name the type "
                f"it stands for: --profile FILE:TYPE."
            )
        for node, by_type in node_times.items():
            times.setdefault(node, {}).update(by_type)
        model = model or node_prof.model
    return cluster, (Profile(model=model, times=times) if times else None)
