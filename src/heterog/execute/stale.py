"""What a local run leaves if it is killed hard, and how the next run removes it; the memory
check before starting local ranks.

A launcher killed by SIGKILL runs no `finally`: its ranks keep running (each in its own
session), its temporary run folder stays, and so do the network namespaces of shaped links.
So every launch registers itself in a registry folder under the system's temp dir: its own
identity (pid and start time, so a reused pid is not mistaken for it), its run folder and its
ranks. A later launch removes whatever belongs to no live launcher: it kills those ranks,
deletes the run folder (only when the launcher made it: a --logs folder is the user's) and
the registry entry, then removes orphan namespaces (netns.remove_stale_namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from heterog.errors import ResourceError
from heterog.ir.plan import Plan
from heterog.jsonio import write_atomic

RUN_PREFIX = "heterog-run-"
REGISTRY = "heterog-live-runs"
# A run folder with no registry entry may belong to a launcher between mkdtemp and claim();
# after this long it cannot.
UNCLAIMED_GRACE_S = 120.0
# Resident memory of one rank beyond the plan's tensors: Python, torch's libraries and the
# gloo buffers. Measured: max_rss_bytes of a rank training the tests' small MLP is 336 MiB
# (`heterog run --json`, torch 2.13 CPU wheel); the margin covers models that import
# transformers and larger communication buffers.
RANK_BASELINE_BYTES = 600 * 2**20


def _registry() -> Path:
    return Path(tempfile.gettempdir()) / REGISTRY


def _identity(pid: int) -> dict[str, float]:
    return {"pid": pid, "create_time": psutil.Process(pid).create_time()}


def _alive(ident: dict[str, Any]) -> bool:
    try:
        return abs(psutil.Process(int(ident["pid"])).create_time() - float(ident["create_time"])) < 1e-3
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError, ValueError):
        return False


def _entry(work: Path) -> Path:
    me = _identity(os.getpid())
    return _registry() / f"{me['pid']}-{work.name}.json"


def claim(work: Path) -> None:
    """Register this process as the owner of run folder `work`."""
    own = work.name.startswith(RUN_PREFIX) and work.parent == Path(tempfile.gettempdir())
    write_atomic(
        _entry(work), json.dumps({"owner": _identity(os.getpid()), "work": str(work), "own_dir": own, "ranks": []})
    )


def record_ranks(work: Path, pids: list[int]) -> None:
    """Add the ranks started so far, so a later run can stop them if we die."""
    entry = _entry(work)
    doc = json.loads(entry.read_text())
    doc["ranks"] = [_identity(p) for p in pids if psutil.pid_exists(p)]
    write_atomic(entry, json.dumps(doc))


def release(work: Path) -> None:
    """The run ended (its finally ran): forget it."""
    _entry(work).unlink(missing_ok=True)


def _kill_ranks(ranks: list[dict[str, Any]]) -> int:
    """SIGKILL the live ones and wait for them to go (they may hold a namespace)."""
    killed: list[psutil.Process] = []
    for ident in ranks:
        if _alive(ident):
            try:
                os.killpg(int(ident["pid"]), signal.SIGKILL)  # each rank leads its own session
                killed.append(psutil.Process(int(ident["pid"])))
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                pass
    psutil.wait_procs(killed, timeout=10)
    return len(killed)


def remove_stale_runs() -> list[str]:
    """Remove what dead launchers left; return one line per thing removed."""
    removed: list[str] = []
    claimed: set[str] = set()
    reg = _registry()
    for entry in sorted(reg.glob("*.json")) if reg.is_dir() else []:
        try:
            doc = json.loads(entry.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if _alive(doc.get("owner", {})):
            claimed.add(doc.get("work", ""))
            continue
        n = _kill_ranks(doc.get("ranks", []))
        if n:
            removed.append(f"{n} orphan rank(s) of {doc.get('work')}")
        if doc.get("own_dir") and Path(doc.get("work", "")).is_dir():
            shutil.rmtree(doc["work"], ignore_errors=True)
            removed.append(f"run folder {doc['work']}")
        entry.unlink(missing_ok=True)
    now = time.time()
    for d in Path(tempfile.gettempdir()).glob(f"{RUN_PREFIX}*"):
        if str(d) not in claimed and d.is_dir() and now - d.stat().st_mtime > UNCLAIMED_GRACE_S:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"unclaimed run folder {d}")
    # netns.py clears stale runs (this module) before it sets up links: a cycle
    from heterog.execute.netns import remove_stale_namespaces

    removed += [f"network namespace {ns}" for ns in remove_stale_namespaces()]
    return removed


def full_model_bytes(plan_doc: dict[str, Any]) -> int:
    """Bytes of the whole model's fp32 parameters (built on the meta device: no memory)."""
    # torch only to size the model: `heterog lower`/`simulate` import this module without it
    import torch

    from heterog.workload import resolve_workload

    work = resolve_workload(Plan.from_dict(plan_doc).model)
    with torch.device("meta"):
        model = work.build()
    return sum(p.numel() for p in model.parameters()) * 4


def check_memory(plan_doc: dict[str, Any], devices: tuple[str, ...], *, force: bool) -> None:
    """Refuse to start ranks whose memory would exceed this machine's available memory.

    Each rank first builds the whole model (so all ranks agree on its initial parameters),
    frees the groups it does not hold, then trains within the plan's predicted peak for its
    device: it needs about max(whole model, predicted peak) plus the process baseline.
    """
    if force:
        return
    peaks = plan_doc.get("predicted_peak_memory_bytes") or {}
    whole = full_model_bytes(plan_doc)
    need = sum(max(whole, int(peaks.get(d, 0))) + RANK_BASELINE_BYTES for d in devices)
    free = psutil.virtual_memory().available
    if need <= free:
        return
    gib = 2**30
    largest = max(devices, key=lambda d: int(peaks.get(d, 0)))
    raise ResourceError(
        f"the plan needs about {need / gib:.1f} GiB on this machine: {len(devices)} local rank(s), each "
        f"building the whole model ({whole / gib:.1f} GiB of parameters) or reaching the plan's predicted "
        f"peak (up to {int(peaks.get(largest, 0)) / gib:.1f} GiB on {largest}), plus "
        f"{RANK_BASELINE_BYTES / gib:.1f} GiB per process; only {free / gib:.1f} GiB is available. Plan a "
        f"smaller model or batch, run on the real cluster (--torchrun), or pass --force to start anyway."
    )
