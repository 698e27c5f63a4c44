"""Checkpoints keyed by parameter name, so a run can resume under another plan.

A checkpoint is a folder `step-<NNNNNNNN>` under the checkpoint directory, written with
torch.distributed.checkpoint (DCP): every rank saves the parameters it holds as
`model/<parameter name>` and its optimizer state as `optim/<parameter name>/<key>`
(e.g. AdamW's exp_avg). DCP writes each replicated tensor once and records which file holds
what, so the layout does not depend on the plan that wrote it.

Atomicity: a checkpoint is complete only when rank 0 has written its marker
(`COMPLETE.json`, atomically) after every rank finished writing. A run killed mid-save leaves
a folder without a marker; loading ignores it and the next save of that step replaces it.

Resuming: each rank of the new run asks for the names it now holds (under its new plan and
cluster: devices lost or added) and DCP reads exactly those. The step counter comes from the
marker; synthetic batches are seeded by step and user data is advanced to that step
(workload.py), so no step is lost or repeated. Not saved: torch's RNG state (the zoo's small
models have no dropout) and BatchNorm running statistics (buffers, not parameters); a
learning-rate schedule is not saved either but moved on to the checkpoint's step
(train_loop.TrainingHooks.resumed).

A sharded block's state (execute/shard.py) is saved the same way: its members gather each
parameter and its optimizer state, and the member holding most of a parameter writes it; on
resume each member reads the parameters overlapping its piece (without the other ranks:
DCP's `no_dist` read) and keeps its slice, so the pieces may be cut differently than when saved.

A parameter server keeps the optimizer state of the parameters it serves per parameter
(collectives.ParameterServer: its flat copy seen as one tensor per parameter); it saves that
state under the same keys a rank-local optimizer writes, so a checkpoint resumes under a plan with another server, or
with none. Loaded state goes on its parameter's device, except the scalar `step` counters,
which stay on the CPU as torch's optimizers keep them (unless capturable or fused).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from heterog.errors import CheckpointError
from heterog.ir.plan import file_sha256, user_model_file
from heterog.ir.provenance import SavedUnder
from heterog.ir.run_request import CheckpointConfig
from heterog.jsonio import from_plain, write_atomic
from heterog.userfile import locate

MARKER = "COMPLETE.json"
STEP_PREFIX = "step-"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint: its folder and what its marker says."""

    path: Path
    step: int  # completed steps when it was written
    model: str
    parameter_names: tuple[str, ...]
    saved_under: SavedUnder | None = None  # the plan and cluster that wrote it (older markers: None)


def model_key(name: str) -> str:
    """The model's identity in a checkpoint, portable as a plan's is: a zoo name, or a user
    file's name, factory and content hash, so that a project copied elsewhere (the same file at
    another path) resumes, and an edited model file is named as the reason it does not."""
    user = user_model_file(name)
    if user is None:
        return name
    path = locate(user[0])
    return f"{path.name}:{user[1]} sha256={file_sha256(path)}"


def check_same_model(saved: str, name: str, where: str) -> None:
    """Refuse to resume a checkpoint of another model than `name`, saying why. A user model
    matches on its factory and file content, wherever the file now is; a checkpoint written
    before content hashes named the file's absolute path, which still matches that path."""
    current = model_key(name)
    if saved == current or _factory_and_hash(saved) == _factory_and_hash(current) != (None, None):
        return
    user = user_model_file(name)
    if user is not None and saved == f"{locate(user[0]).resolve()}:{user[1]}":
        return
    then, now = _factory_and_hash(saved), _factory_and_hash(current)
    if then[0] is not None and then[0] == now[0] and then[1] and now[1]:
        raise CheckpointError(
            f"{where}: the model file changed since the checkpoint was written (factory {now[0]!r}, sha256 "
            f"{then[1][:12]}… then, {now[1][:12]}… now); restore the file the checkpoint was trained with, or "
            f"start without --resume."
        )
    raise CheckpointError(
        f"{where}: the checkpoint is of model {saved!r}, but the plan trains {current!r}; resume with a plan of "
        f"the same model."
    )


def _factory_and_hash(key: str) -> tuple[str | None, str | None]:
    """(factory, sha256) of a user model's key, (None, None) for a zoo name or an old key."""
    head, sep, digest = key.rpartition(" sha256=")
    if not sep:
        return None, None
    return head.rpartition(":")[2], digest


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def read_marker(folder: Path) -> CheckpointInfo | None:
    """The checkpoint in `folder`, or None when it is incomplete (no marker)."""
    try:
        doc = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{folder / MARKER}: unreadable checkpoint marker ({e}); delete the "
            f"folder {folder} to fall back to an earlier checkpoint."
        ) from None
    if doc.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{folder}: checkpoint format {doc.get('format')!r} is not supported "
            f"(this heterog reads format {CHECKPOINT_FORMAT})."
        )
    under = doc.get("saved_under")
    return CheckpointInfo(
        path=folder,
        step=int(doc["step"]),
        model=str(doc["model"]),
        parameter_names=tuple(doc["parameter_names"]),
        saved_under=from_plain(SavedUnder, under, f"{folder / MARKER}: saved_under") if under else None,
    )


def find_checkpoint(path: str | Path) -> CheckpointInfo:
    """The checkpoint to resume from: `path` itself when it is one, else the complete
    checkpoint with the most steps under it."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"--resume {path}: no such folder; give the --checkpoint-dir of an earlier run.")
    own = read_marker(root)
    if own is not None:
        return own
    found = [info for d in sorted(root.glob(f"{STEP_PREFIX}*")) if (info := read_marker(d)) is not None]
    if not found:
        partial = sorted(d.name for d in root.glob(f"{STEP_PREFIX}*"))
        raise CheckpointError(
            f"--resume {path}: holds no complete checkpoint"
            + (
                f" ({', '.join(partial)} lack their {MARKER} marker: the run was stopped while saving)"
                if partial
                else ""
            )
            + "; start without --resume or point it at another folder."
        )
    return max(found, key=lambda info: info.step)


def _state(
    named_params: list[tuple[str, nn.Parameter]],
    opt: torch.optim.Optimizer | None,
    servers: Sequence[Any] = (),
    shards: Any = None,
    tp: Any = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {f"model/{name}": p.detach() for name, p in named_params}
    if shards is not None:  # the pieces of sharded blocks, whole per parameter (every rank calls)
        state.update(shards.full_state(opt, with_params=False))
    server_held = {n for served in servers for n in served.names}  # their server's state is the live one
    if opt is not None:
        for name, p in named_params:
            if name in server_held:
                continue
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):  # SGD without momentum keeps none
                    state[f"optim/{name}/{key}"] = value
    for served in servers:  # a parameter server's state, per parameter (module docstring)
        for name, pieces in served.server.state_by_name(served.names, served.shapes).items():
            for key, value in pieces.items():
                state[f"optim/{name}/{key}"] = value
    if tp is not None:  # a tensor-parallel member's slices, whole (collective over its set, in one order)
        state = {k: tp.whole(_name_of(k), v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return state


def _name_of(key: str) -> str:
    """The parameter name of a state entry: 'model/<name>' or 'optim/<name>/<state key>'."""
    return key.split("/")[1]


def save_checkpoint(
    root: str | Path,
    step: int,
    named_params: list[tuple[str, nn.Parameter]],
    opt: torch.optim.Optimizer | None,
    *,
    rank: int,
    model: str,
    servers: Sequence[Any] = (),
    shards: Any = None,
    saved_under: SavedUnder | None = None,
    tp: Any = None,
) -> Path:
    """Every rank calls this after `step` completed steps; returns the checkpoint folder."""
    target = step_dir(root, step)
    if rank == 0:
        if target.exists():  # an incomplete save of this step by a stopped run
            shutil.rmtree(target)
        target.mkdir(parents=True)
    dist.barrier()
    state = _state(named_params, opt, servers, shards, tp)
    dcp.save(state, checkpoint_id=target)
    names: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    held = sorted({k.split("/")[1] for k in state if k.startswith("model/")})
    dist.all_gather_object(names, held)  # also: every rank finished writing
    if rank == 0:
        write_atomic(
            target / MARKER,
            json.dumps(
                {
                    "format": CHECKPOINT_FORMAT,
                    "step": step,
                    "model": model_key(model),
                    "parameter_names": sorted({n for per_rank in names for n in per_rank}),
                    "saved_under": saved_under.to_dict() if saved_under is not None else None,
                }
            ),
        )
    dist.barrier()
    return target


def _stepped(
    named_params: list[tuple[str, nn.Parameter]], opt: torch.optim.Optimizer | None
) -> list[tuple[str, nn.Parameter]]:
    """The named parameters the optimizer steps itself."""
    if opt is None:
        return []
    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    return [(name, p) for name, p in named_params if id(p) in ids]


def _state_device(opt: torch.optim.Optimizer, key: str, p: torch.Tensor) -> torch.device:
    """Where torch's optimizers keep a state entry: `step` on the CPU unless the optimizer is
    capturable or fused, everything else beside its parameter."""
    if key == "step":
        group = opt.param_groups[0] if opt.param_groups else {}
        return p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
    return p.device


def load_checkpoint(
    info: CheckpointInfo,
    named_params: list[tuple[str, nn.Parameter]],
    opt: torch.optim.Optimizer | None,
    *,
    model: str,
    servers: Sequence[Any] = (),
    shards: Any = None,
    tp: Any = None,
) -> None:
    """Load the parameters (in place) and optimizer state this rank holds, by name, the
    state of the parameter servers it runs, and the pieces of its sharded blocks. `servers`
    also lists the buckets this rank is a replica of (ProgramSync.ps_buckets): their state
    goes to their server only, not into the local optimizer, where it would never move and,
    saved again beside the server's, could be the copy DCP keeps of the two. `tp`: a
    tensor-parallel member's slices (tp_rank.TensorParallelState), read whole and cut."""
    server_held = {n for served in servers for n in served.names}
    check_same_model(info.model, model, str(info.path))
    meta = dcp.FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    state, sliced = _parameter_entries(info, meta, named_params, tp)
    wanted: list[tuple[str, str, torch.device]] = []  # (name, state key, device)
    # a sharded block's parameters: their piece's state; a served one's: its server's
    stepped = [(name, p) for name, p in _stepped(named_params, opt) if name not in server_held]
    if opt is not None:
        wanted += [(name, key, _state_device(opt, key, p)) for name, p in stepped for key in _keys(meta, name)]
    for served in servers:
        server = served.server
        wanted += (
            [
                (name, key, _state_device(server.optimizer, key, server.master))
                for name in served.names
                for key in _keys(meta, name)
            ]
            if server.optimizer is not None
            else []
        )
    for name, key, device in wanted:
        m = _tensor_meta(meta, f"optim/{name}/{key}")
        state[f"optim/{name}/{key}"] = torch.empty(tuple(m.size), dtype=m.properties.dtype, device=device)
    dcp.load(state, checkpoint_id=info.path)
    if tp is not None:  # the whole tensors read for this member's slices: its slice
        with torch.no_grad():
            for name, p in sliced:
                p.copy_(tp.mine(name, state[f"model/{name}"]))
        state = {k: tp.mine(_name_of(k), v).contiguous() if k.startswith("optim/") else v for k, v in state.items()}
    if opt is not None:
        for name, p in stepped:
            for key in _keys(meta, name):
                opt.state[p][key] = state[f"optim/{name}/{key}"]
    for served in (s for s in servers if s.server.optimizer is not None):  # the ones this rank serves
        served.server.load_state(
            {name: {key: state[f"optim/{name}/{key}"] for key in _keys(meta, name)} for name in served.names},
            served.names,
        )
    if shards is not None:
        _missing_sharded(info, meta, shards)
        shards.load(
            _Reader(info.path, meta, tp),
            opt,
            lambda key, p: _state_device(opt, key, p) if opt is not None else p.device,
        )


def _parameter_entries(
    info: CheckpointInfo, meta: dict[str, Any], named_params: list[tuple[str, nn.Parameter]], tp: Any
) -> tuple[dict[str, Any], list[tuple[str, nn.Parameter]]]:
    """Where each parameter is read to (itself; a tensor-parallel member's slice: a whole
    tensor, cut after the read), and the parameters read whole; a CheckpointError naming a
    parameter the checkpoint lacks or holds in another shape."""
    state: dict[str, Any] = {}
    sliced: list[tuple[str, nn.Parameter]] = []
    for name, p in named_params:
        key = f"model/{name}"
        if key not in meta:
            raise CheckpointError(
                f"{info.path}: holds no parameter {name!r}; it was written for a "
                f"different model version (it holds {len(info.parameter_names)} parameters)."
            )
        saved = _tensor_meta(meta, key)
        whole = tp.whole_shape(name, tuple(p.shape)) if tp is not None else tuple(p.shape)
        if tuple(saved.size) != whole:
            raise CheckpointError(
                f"{info.path}: parameter {name!r} has shape {tuple(saved.size)} in the "
                f"checkpoint but {whole} in the model; check --model-arg values."
            )
        if whole == tuple(p.shape):
            state[key] = p.detach()
        else:  # a member's slice: read whole, cut below
            state[key] = torch.empty(whole, dtype=p.dtype, device=p.device)
            sliced.append((name, p))
    return state, sliced


class _Reader:
    """Full per-name tensors from a checkpoint for one rank alone (shard.ShardRunner.load)."""

    def __init__(self, path: Path, meta: dict[str, Any], tp: Any = None):
        self.path, self.meta, self.tp = path, meta, tp

    def keys_of(self, name: str) -> list[str]:
        return _keys(self.meta, name)

    def empty(self, key: str, device: torch.device) -> torch.Tensor:
        """A tensor of what this rank holds of entry `key` (a member's slice: its shape)."""
        m = _tensor_meta(self.meta, key)
        whole = torch.empty(tuple(m.size), dtype=m.properties.dtype, device="meta")
        shape = self.tp.mine(_name_of(key), whole).shape if self.tp is not None else whole.shape
        return torch.empty(shape, dtype=m.properties.dtype, device=device)

    def __call__(self, entries: dict[str, torch.Tensor]) -> None:
        if self.tp is None:
            dcp.load(entries, checkpoint_id=self.path, no_dist=True)
            return
        wholes = {k: torch.empty(tuple(_tensor_meta(self.meta, k).size), dtype=v.dtype) for k, v in entries.items()}
        dcp.load(wholes, checkpoint_id=self.path, no_dist=True)
        for k, v in entries.items():
            v.copy_(self.tp.mine(_name_of(k), wholes[k]))


def _missing_sharded(info: CheckpointInfo, meta: dict[str, Any], shards: Any) -> None:
    missing = sorted(n for n in shards.hidden_names() if f"model/{n}" not in meta)
    if missing:
        raise CheckpointError(
            f"{info.path}: holds no parameter {missing[0]!r}; it was written for a different model "
            f"version (it holds {len(info.parameter_names)} parameters)."
        )


def _tensor_meta(meta: Any, key: str) -> TensorStorageMetadata:
    """The saved metadata of tensor `key` (parameters and optimizer state are tensors)."""
    m = meta[key]
    if not isinstance(m, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint entry {key!r} is not a tensor; it was written by another program.")
    return m


def _keys(meta: dict[str, Any], name: str) -> list[str]:
    """The optimizer state keys the checkpoint holds for parameter `name`."""
    prefix = f"optim/{name}/"
    return [k[len(prefix) :] for k in meta if k.startswith(prefix)]


# -- the two calls the worker's training loop makes --------------------------------------------


def resume(
    cfg: CheckpointConfig,
    named_params: list[tuple[str, nn.Parameter]],
    opt: torch.optim.Optimizer | None,
    *,
    model: str,
    servers: Sequence[Any] = (),
    shards: Any = None,
    tp: Any = None,
) -> int:
    """Load cfg.resume's checkpoint when given; return the first step to run (0 without)."""
    if not cfg.resume:
        return 0
    info = find_checkpoint(cfg.resume)
    load_checkpoint(info, named_params, opt, model=model, servers=servers, shards=shards, tp=tp)
    return info.step


def save_if_due(
    cfg: CheckpointConfig,
    completed_steps: int,
    named_params: list[tuple[str, nn.Parameter]],
    opt: torch.optim.Optimizer | None,
    *,
    rank: int,
    model: str,
    servers: Sequence[Any] = (),
    shards: Any = None,
    tp: Any = None,
) -> None:
    """Save after every cfg.every_steps-th completed step (all ranks call it, same step)."""
    if cfg.dir and cfg.saves_after(completed_steps):
        save_checkpoint(
            cfg.dir,
            completed_steps,
            named_params,
            opt,
            rank=rank,
            model=model,
            servers=servers,
            shards=shards,
            saved_under=cfg.saved_under,
            tp=tp,
        )
