"""Captured graphs (and what the executor can cut of a model) kept on disk, so that a command
given a plan does not capture or export its model again.

A capture costs seconds (importing torch and transformers, two recorded iterations on fake
tensors); reading the graph's JSON back costs milliseconds. `capture_cached` is
`capture_model` through this cache, and every path that builds a plan's inputs
(heterog/inputs.py: plan, simulate, report, lower, run) goes through it.

- Content-addressed: the key hashes the model spec (name, arguments, batch size, sequence
  length), the bytes of a user model's file and of the Python files beside it (which it may
  import), the versions of Python, torch and transformers, and heterog's own capture and
  graph code. Anything that could change the graph changes the key; a stale entry is never
  read, it only waits for eviction.
- Safe under concurrent runs: an entry is written to a temporary file and renamed into place
  (jsonio.write_atomic), so a reader sees a whole graph or none; two writers of one key write
  the same graph. A damaged or vanished entry is a miss: the model is captured again.
- Bounded: after a write, the least recently used entries (by modification time, which a hit
  refreshes) are deleted until the folder holds at most $HETEROG_GRAPH_CACHE_MIB MiB
  (default 512).
- Where: `captures/` in the user's cache folder (heterog/cachedir.py); HETEROG_GRAPH_CACHE=0
  turns the cache off.

The same store keeps each model's cut constraints (search/constraints.py: a torch.export of
the model, seconds to tens of seconds), keyed the same way with the exporting code's sources.
In-memory modules (heterog.plan(module, …)) are not cached: nothing names them across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from heterog import __version__
from heterog.cachedir import cache_dir
from heterog.capture.models import MODEL_INFO, is_user_model, unknown_model_error
from heterog.errors import ArtifactError
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import in_memory_model_error
from heterog.jsonio import write_atomic
from heterog.userfile import locate

LIMIT_ENV = "HETEROG_GRAPH_CACHE_MIB"
SWITCH_ENV = "HETEROG_GRAPH_CACHE"
DEFAULT_LIMIT_MIB = 512
KEY_VERSION = 1
GRAPH_CODE = ("capture", "ir")  # the code a captured graph depends on


def store_dir() -> Path:
    return cache_dir() / "captures"


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "no", "off", "false")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


@lru_cache(maxsize=8)
def code_fingerprint(*parts: str) -> str:
    """The sources of heterog's `parts` (folders or files under the package): an edited
    recorder, zoo model or exporter makes new keys."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in parts:
        target = root / part
        for f in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _user_files(name: str) -> dict[str, str]:
    """A user model 'path/file.py:factory': the hashes of its file and of the Python files
    beside it (its factory may import them)."""
    path = name.rpartition(":")[0]
    if not path.endswith(".py"):
        return {}
    file = locate(path)
    if not file.is_file():
        return {}  # capture_model says what is wrong
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(file.resolve().parent.glob("*.py"))
        if f.is_file()
    }


def model_key(kind: str, name: str, model_args: dict[str, Any] | None, *, code: tuple[str, ...], **more: Any) -> str:
    """The key of one cached result of `kind` about a model (a hex digest): the model spec,
    a user file's bytes and its neighbours', the package versions and `code`'s sources."""
    doc = {
        "key_version": KEY_VERSION,
        "kind": kind,
        "model": name,
        "args": model_args or {},
        **more,
        "files": _user_files(name),
        "heterog": __version__,
        "code": code_fingerprint(*code),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def graph_key(name: str, model_args: dict[str, Any] | None, batch_size: int, seq_len: int | None) -> str:
    """The cache key of one capture."""
    return model_key("graph", name, model_args, code=GRAPH_CODE, batch_size=batch_size, seq_len=seq_len)


def entry_path(kind: str, key: str) -> Path:
    return store_dir() / f"{kind}-{key}.json"


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # most recently used
    except OSError:
        pass


def load_json(kind: str, key: str) -> Any | None:
    """A stored JSON document, or None (disabled, missing, evicted, damaged)."""
    path = entry_path(kind, key)
    if not enabled() or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    _touch(path)
    return doc


def store_json(kind: str, key: str, doc: Any) -> None:
    """Store a JSON document atomically, then bound the store's size."""
    if not enabled():
        return
    try:
        write_atomic(entry_path(kind, key), json.dumps(doc))
        _evict(store_dir(), _limit_bytes())
    except OSError:
        pass  # a read-only or full disk: the result still serves this run


def _read(path: Path) -> OpGraph | None:
    try:
        graph = OpGraph.load(path)
    except (ArtifactError, OSError, ValueError, KeyError, TypeError):
        return None  # missing, half-evicted or damaged: capture again
    _touch(path)
    return graph


def _evict(folder: Path, limit_bytes: int) -> None:
    """Delete the least recently used entries until the folder holds at most limit_bytes."""
    entries = []
    for f in folder.glob("*.json"):
        try:
            st = f.stat()
        except FileNotFoundError:
            continue  # another process evicted it
        entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    for _, size, f in sorted(entries):
        if total <= limit_bytes:
            break
        try:
            f.unlink()
        except FileNotFoundError:
            pass
        total -= size


def _limit_bytes() -> int:
    try:
        return int(float(os.environ.get(LIMIT_ENV, DEFAULT_LIMIT_MIB)) * 2**20)
    except ValueError:
        return DEFAULT_LIMIT_MIB * 2**20


def _capture(name: str, model_args: dict[str, Any] | None, batch_size: int, seq_len: int | None) -> OpGraph:
    from heterog.capture.capture import capture_model  # imports torch: only when capturing

    return capture_model(name, model_args, batch_size=batch_size, seq_len=seq_len)


def capture_cached(
    name: str, model_args: dict[str, Any] | None = None, *, batch_size: int, seq_len: int | None = None
) -> OpGraph:
    """capture_model(name, model_args, batch_size=…, seq_len=…), read from the cache when this
    exact capture was made before; `meta["graph_cache"]` says "hit" or "miss"."""
    if name not in MODEL_INFO and not is_user_model(name) and in_memory_model_error(name) is None:
        raise unknown_model_error(name)  # before importing torch: a typo is answered at once
    if not enabled():
        return _capture(name, model_args, batch_size, seq_len)
    path = entry_path("graph", graph_key(name, model_args, batch_size, seq_len))
    started = time.perf_counter()
    graph = _read(path) if path.is_file() else None
    if graph is not None:
        graph.meta["graph_cache"] = "hit"
        graph.meta["load_time_s"] = round(time.perf_counter() - started, 4)
        return graph
    graph = _capture(name, model_args, batch_size, seq_len)
    try:
        graph.save(path)
        _evict(store_dir(), _limit_bytes())
    except OSError:
        pass  # a read-only or full disk: the capture still serves this run
    graph.meta["graph_cache"] = "miss"
    return graph


# Graphs of in-memory modules planned in this interpreter (heterog.plan(module, …)), by
# fingerprint: their plans can be simulated and reported here, as a zoo model's can anywhere.
_IN_MEMORY: dict[str, OpGraph] = {}
_IN_MEMORY_MAX = 16


def remember_in_memory(graph: OpGraph) -> None:
    _IN_MEMORY.pop(graph.fingerprint(), None)
    _IN_MEMORY[graph.fingerprint()] = graph
    while len(_IN_MEMORY) > _IN_MEMORY_MAX:
        _IN_MEMORY.pop(next(iter(_IN_MEMORY)))


def in_memory_graph(fingerprint: str) -> OpGraph | None:
    return _IN_MEMORY.get(fingerprint)
