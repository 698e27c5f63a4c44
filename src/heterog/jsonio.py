"""Versioned JSON artifacts written atomically (never a half-written file over user data)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

from heterog.errors import ArtifactError


def _current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc, since 4.7);
    elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path through a temporary file in the same folder and an atomic rename.

    The file gets the permissions a plain open() would give it — an existing file's own, a new
    one 0666 less the umask — not the temporary file's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:
        mode = 0o666 & ~_current_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_artifact(path: str | os.PathLike, kind: str, version: int, body: dict[str, Any]) -> None:
    """Save `body` as an artifact of `kind` at schema `version`."""
    doc = {"kind": kind, "version": version, **body}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=False) + "\n")


def load_artifact(path: str | os.PathLike, kind: str, version: int, *, older: tuple[int, ...] = ()) -> dict[str, Any]:
    """Read an artifact file and check its kind and version (`version`, or one of the `older`
    versions the caller still reads); the caller validates the body."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file; check the path.") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror}).") from None
    return parse_artifact(text, kind, version, source=str(path), older=older)


def parse_artifact(
    text: str, kind: str, version: int, *, source: str = "<string>", older: tuple[int, ...] = ()
) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(
            f"{source}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}). "
            f"Was it written by heterog, and completely?"
        ) from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{source}: expected a JSON object holding a {kind}, found {type(doc).__name__}.")
    if doc.get("kind") != kind:
        raise ArtifactError(f"{source}: this file holds a {doc.get('kind')!r} artifact, but a {kind!r} was expected.")
    if doc.get("version") != version and doc.get("version") not in older:
        raise ArtifactError(
            f"{source}: {kind} schema version {doc.get('version')!r} is not supported "
            f"(this heterog reads version {version}); re-create the file with this version."
        )
    return doc


class Artifact:
    """Save, load, from_json and to_json for every versioned artifact class, written once so
    that each artifact is written atomically and read with the same kind/version checks and
    error messages.

    A subclass names its kind and schema version in its class statement,
    `class Plan(Artifact, kind=KIND, version=SCHEMA_VERSION)` (with `older=(1,)` for the
    earlier versions its `from_dict` still reads), and supplies `to_dict()` (the
    body) and `from_dict(doc, source=...)`, which validates the body and names `source` in its
    errors; its default `source` (e.g. "<plan>") stands for a document given as a string."""

    __slots__ = ()
    KIND: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]
    OLDER_VERSIONS: ClassVar[tuple[int, ...]]

    if TYPE_CHECKING:  # what each subclass supplies (as the docstring says)

        def to_dict(self) -> dict[str, Any]: ...

        @classmethod
        def from_dict(cls, doc: dict[str, Any], source: str = ...) -> Self: ...

    def __init_subclass__(cls, *, kind: str, version: int, older: tuple[int, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.KIND, cls.SCHEMA_VERSION, cls.OLDER_VERSIONS = kind, version, older

    def to_json(self) -> str:
        """The whole document (kind, version, body) on one line."""
        return json.dumps({"kind": self.KIND, "version": self.SCHEMA_VERSION, **self.to_dict()})

    def save(self, path: str | os.PathLike) -> None:
        save_artifact(path, self.KIND, self.SCHEMA_VERSION, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Self:
        return cls.from_dict(load_artifact(path, cls.KIND, cls.SCHEMA_VERSION, older=cls.OLDER_VERSIONS), str(path))

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(parse_artifact(text, cls.KIND, cls.SCHEMA_VERSION, older=cls.OLDER_VERSIONS))
