"""Versioned JSON artifacts written atomically (never a half-written file over user data)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import tempfile
import types
import typing
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


# -- records: frozen dataclasses to and from plain JSON ----------------------------------------
# The run side's records (ir/run_request.py, ir/run_result.py, execute/spec.py) nest small
# dataclasses, tuples, enums and optional fields; one converter reads and writes them all, and
# names the offending field when a document does not fit its type.
def to_plain(value: Any) -> Any:
    """A dataclass (fields whose metadata says json=False left out), tuple, dict or enum as
    plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.metadata.get("json", True)
        }
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def from_plain(cls: Any, doc: Any, where: str) -> Any:
    """`doc` read as type `cls` (a dataclass, or a type its fields use), checked all the way
    down; an ArtifactError names the field at fault (`where`, e.g. 'run.json: per_rank[0]')."""
    origin = typing.get_origin(cls)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(cls)
        if doc is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return from_plain(option, doc, where)
            except ArtifactError as e:
                errors.append(str(e))
        raise ArtifactError(errors[0] if len(errors) == 1 else f"{where}: {doc!r} fits none of {cls}.")
    if origin is tuple:
        args = typing.get_args(cls)
        if not isinstance(doc, (list, tuple)):
            raise ArtifactError(f"{where}: expected a list, found {type(doc).__name__}.")
        kinds = [args[0]] * len(doc) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(kinds) != len(doc):
            raise ArtifactError(f"{where}: expected {len(kinds)} items, found {len(doc)}.")
        return tuple(from_plain(k, v, f"{where}[{i}]") for i, (k, v) in enumerate(zip(kinds, doc)))
    if origin is dict:
        key_type, value_type = typing.get_args(cls)
        if not isinstance(doc, dict):
            raise ArtifactError(f"{where}: expected an object, found {type(doc).__name__}.")
        return {from_plain(key_type, k, where): from_plain(value_type, v, f"{where}[{k!r}]") for k, v in doc.items()}
    if dataclasses.is_dataclass(cls):
        return _dataclass_from_plain(cls, doc, where)
    return _scalar_from_plain(cls, doc, where)


def _dataclass_from_plain(cls: Any, doc: Any, where: str) -> Any:
    if not isinstance(doc, dict):
        raise ArtifactError(f"{where}: expected an object ({cls.__name__}), found {type(doc).__name__}.")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or not f.metadata.get("json", True) or f.name not in doc:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.init:
                raise ArtifactError(f"{where}: field {f.name!r} is missing.")
            continue
        kwargs[f.name] = from_plain(hints[f.name], doc[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{where}: {e}") from None


def _scalar_from_plain(cls: Any, doc: Any, where: str) -> Any:
    if cls is Any:
        return doc
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        try:
            return cls(doc)
        except ValueError:
            choices = ", ".join(str(m.value) for m in cls)
            raise ArtifactError(f"{where}: {doc!r} is not one of {choices}.") from None
    if cls is float and isinstance(doc, (int, float)) and not isinstance(doc, bool):
        return float(doc)
    if cls in (int, str, bool) and type(doc) is cls:
        return doc
    if cls is type(None) and doc is None:
        return None
    raise ArtifactError(f"{where}: expected {getattr(cls, '__name__', cls)}, found {doc!r}.")


class Record:
    """to_dict / from_dict by field types (to_plain / from_plain), for a frozen dataclass whose
    fields are JSON-able records, tuples, dicts, enums and scalars; mixed with Artifact it is a
    versioned file too."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "") -> Self:
        return from_plain(cls, doc, source or f"<{cls.__name__}>")
