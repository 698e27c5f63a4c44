"""The device profile: what `heterog profile` measured on one device, as a versioned,
validated artifact (JSON, kind 'heterog.DeviceProfile', version 1):

    {"kind": "heterog.DeviceProfile", "version": 1,
     "device": {"type": "H200" | "cpu", "name": "NVIDIA H200", "torch": "2.11.0", "host": "<cpu model>"},
     "gemm":  [{"n": 4096, "dtype": "bf16", "time_s": 1.9e-4}, ...],          # square products
     "copy":  {"bytes": 2.1e9, "time_s": 4.9e-4},                              # read + written
     "host":  {"forward_op_s": .., "backward_op_s": .., "module_call_s": .., "autocast_cast_s": ..},
     "comm":  {"backend": "nccl", "world_size": 2, "rows": [{"bytes", "allreduce_s", "p2p_s"}]},
     "steps": [{"model", "batch_size", "seq_len", "precision", "optimizer", "time_s", "peak_bytes"}],
     "nodes": <a heterog.Profile body: per-node forward/backward times at each batch size>,
     "host_speed": 0.8}     # this machine's host relative to the reference host (from the GPU
                            # steps; a cluster YAML node's `host_speed`)

Every section but `device` is optional, so the shared measurement files (h200_micro.json's
matmul sweep and copy, h200_steps.json's steps) convert into one (`from_shared_files`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterog.cost.profile import Profile
from heterog.errors import ArtifactError
from heterog.jsonio import Artifact

KIND = "heterog.DeviceProfile"
SCHEMA_VERSION = 1
GEMM_DTYPES = ("fp32", "tf32", "fp16", "bf16")
HOST_KEYS = ("forward_op_s", "backward_op_s", "module_call_s", "autocast_cast_s")


class DeviceProfileError(ArtifactError):
    """A malformed device profile."""


def _positive(where: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise DeviceProfileError(f"{where}: expected a positive number, found {v!r}.")
    return float(v)


@dataclass(frozen=True, kw_only=True)
class DeviceProfile(Artifact, kind=KIND, version=SCHEMA_VERSION):
    device: dict[str, str]
    gemm: tuple[dict[str, Any], ...] = ()
    copy: dict[str, float] | None = None
    host: dict[str, float] | None = None
    comm: dict[str, Any] | None = None
    steps: tuple[dict[str, Any], ...] = ()
    nodes: Profile | None = None
    host_speed: float | None = None  # relative to the reference host; None: not measured
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return self.device.get("type", "")

    def copy_bandwidth_bytes_per_s(self) -> float | None:
        return None if self.copy is None else self.copy["bytes"] / self.copy["time_s"]

    # -- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "device": dict(self.device),
            "gemm": [dict(g) for g in self.gemm],
            "copy": self.copy,
            "host": self.host,
            "comm": self.comm,
            "steps": [dict(s) for s in self.steps],
            "nodes": None if self.nodes is None else self.nodes.to_dict(),
            "host_speed": self.host_speed,
            "meta": self.meta,
        }

    @staticmethod
    def from_dict(doc: dict[str, Any], source: str = "<device profile>") -> DeviceProfile:
        dev = doc.get("device")
        if not isinstance(dev, dict) or not isinstance(dev.get("type"), str) or not dev["type"]:
            raise DeviceProfileError(
                f"{source}: 'device' must give the device 'type' (a catalog GPU type "
                f'or \'cpu\'), e.g. {{"type": "H200"}}.'
            )
        gemm = []
        for i, g in enumerate(doc.get("gemm") or []):
            where = f"{source}: gemm[{i}]"
            if not isinstance(g, dict) or g.get("dtype") not in GEMM_DTYPES:
                raise DeviceProfileError(f"{where}: expected {{'n', 'dtype' in {GEMM_DTYPES}, 'time_s'}}, found {g!r}.")
            gemm.append(
                {
                    "n": int(_positive(f"{where}.n", g.get("n"))),
                    "dtype": g["dtype"],
                    "time_s": _positive(f"{where}.time_s", g.get("time_s")),
                }
            )
        copy = doc.get("copy")
        if copy is not None:
            copy = {k: _positive(f"{source}: copy.{k}", (copy or {}).get(k)) for k in ("bytes", "time_s")}
        host = doc.get("host")
        if host is not None:
            if not isinstance(host, dict):
                raise DeviceProfileError(f"{source}: 'host' must map {HOST_KEYS} to seconds.")
            unknown = sorted(set(host) - set(HOST_KEYS))
            if unknown:
                raise DeviceProfileError(f"{source}: host has unknown key(s) {unknown}; use {', '.join(HOST_KEYS)}.")
            host = {k: float(v) for k, v in host.items()}
            for k, v in host.items():
                if not (math.isfinite(v) and v >= 0):
                    raise DeviceProfileError(f"{source}: host.{k} must be ≥ 0 seconds, found {v!r}.")
        steps = []
        for i, s in enumerate(doc.get("steps") or []):
            where = f"{source}: steps[{i}]"
            if not isinstance(s, dict) or not isinstance(s.get("model"), str):
                raise DeviceProfileError(f"{where}: expected a step with 'model', 'batch_size', 'time_s'.")
            steps.append(
                {
                    **s,
                    "batch_size": int(_positive(f"{where}.batch_size", s.get("batch_size"))),
                    "time_s": _positive(f"{where}.time_s", s.get("time_s")),
                }
            )
        nodes = doc.get("nodes")
        speed = doc.get("host_speed")
        if speed is not None:
            speed = _positive(f"{source}: host_speed (the host's speed relative to the reference host)", speed)
        return DeviceProfile(
            device={k: str(v) for k, v in dev.items()},
            gemm=tuple(gemm),
            copy=copy,
            host=host,
            comm=doc.get("comm"),
            steps=tuple(steps),
            nodes=None if nodes is None else Profile.from_dict(nodes, f"{source}: nodes"),
            host_speed=speed,
            meta=dict(doc.get("meta") or {}),
        )

    @staticmethod
    def from_shared_files(paths: Sequence[str | Path], device_type: str) -> DeviceProfile:
        """A profile from files in the format of the project's shared measurements: a
        micro-benchmark file ('matmul' rows with m/n/k, dtype, median_ms; 'copy' with gbps)
        and/or a steps file ('steps' rows with name, batch_size, seq_len, mode, median_ms,
        peak_mem_bytes)."""
        gemm: list[dict] = []
        copy, steps, name = None, [], ""
        for p in paths:
            try:
                doc = json.loads(Path(p).read_text())
            except (OSError, ValueError) as e:
                raise DeviceProfileError(f"{p}: cannot be read as JSON ({e}).") from None
            name = name or str((doc.get("env") or {}).get("name") or (doc.get("env") or {}).get("device") or "")
            for r in doc.get("matmul") or []:
                gemm.append({"n": int(r["m"]), "dtype": r["dtype"], "time_s": r["median_ms"] * 1e-3})
            if isinstance(doc.get("copy"), dict) and "gbps" in doc["copy"]:
                copy = {"bytes": 1e9 * doc["copy"]["gbps"], "time_s": 1.0}
            for s in doc.get("steps") or []:
                steps.append(
                    {
                        "model": s["name"].replace("_", "-"),
                        "batch_size": s["batch_size"],
                        "seq_len": s.get("seq_len"),
                        "precision": "amp-bf16" if s["mode"] == "bf16" else "fp32",
                        "optimizer": "sgd" if s.get("family") == "cnn" else "adamw",
                        "recompute": bool(s.get("ckpt")),
                        "time_s": s["median_ms"] * 1e-3,
                        "peak_bytes": s.get("peak_mem_bytes"),
                    }
                )
        if not (gemm or copy or steps):
            raise DeviceProfileError(
                f"{', '.join(map(str, paths))}: no 'matmul', 'copy' or 'steps' found; "
                f"give heterog profile output, or a sweep ('matmul' rows of m, dtype, "
                f"median_ms; 'copy' with gbps) and/or 'steps' rows."
            )
        return DeviceProfile.from_dict(
            {
                "device": {"type": device_type, "name": name},
                "gemm": gemm,
                "copy": copy,
                "steps": steps,
                "meta": {"converted_from": [str(p) for p in paths]},
            }
        )
