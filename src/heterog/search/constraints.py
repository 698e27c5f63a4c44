"""What the executor can cut, as the search needs it: a model's CutConstraints, cached.

The executor splits a model at group boundaries through torch.export (cut/partition.py).
Two things there constrain a plan (cut/split_export.py `CutConstraints`): nodes that
depend on no input data run in their consumers' groups whatever the plan says
(`follow_consumers`), and a value without a sample dimension that needs a gradient (a batch
statistic) cannot cross between groups of different placements (`same_placement`). A model
torch.export cannot take is not splittable at all: only plans whose groups all share one
placement run. grouping.py turns the first two into the grouping itself; planner.py refuses
candidates that need a split of an unsplittable model.

Exporting a model takes seconds, so the constraints are computed once per model and kept in
a `ConstraintCache` owned by the caller (the planner's default one lives in this module), and
on disk in the store of captured graphs (capture/cache.py), so later commands skip the export.
The model is built on the meta device (no parameter memory at any size) and exported there;
a model that only exports on real tensors is tried again on the CPU at a tiny batch.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from heterog.capture.cache import load_json, model_key, store_json
from heterog.capture.zoo import get_zoo_model
from heterog.cut.split_export import cut_constraints
from heterog.errors import ModelError
from heterog.ir.plan import IN_MEMORY_PREFIX, ModelSpec

log = logging.getLogger(__name__)

EXPORT_BATCH = 2  # the batch is exported as a symbol: any small example works


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCuts:
    """The search's view of what the executor can cut for one model."""

    splittable: bool  # torch.export takes the model
    follow_consumers: frozenset[str] = frozenset()
    same_placement: frozenset[tuple[str, str]] = frozenset()
    reason: str = ""  # why not splittable

    @classmethod
    def unconstrained(cls) -> ModelCuts:
        return cls(splittable=True)


def _key(spec: ModelSpec) -> str:
    """Cache key: the model and its arguments (not the batch: the export's batch is symbolic);
    a user file's modification time, so an edited model is exported again."""
    name = spec.name
    stamp = 0.0
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        path = name.split(":", 1)[0]
        stamp = os.path.getmtime(path) if os.path.exists(path) else 0.0
    return json.dumps([name, spec.args, spec.seq_len, stamp], sort_keys=True, default=str)


def model_cuts(spec: ModelSpec) -> ModelCuts:
    """Export `spec`'s model once (meta device first, then CPU) and read its constraints."""
    try:
        entry = get_zoo_model(spec.name)
    except ModelError as e:  # e.g. a model held in memory: the executor cannot build it anyway
        log.info("no cut constraints for %s: %s", spec.name, e)
        return ModelCuts.unconstrained()
    args = dict(spec.args)
    seq = spec.seq_len or getattr(entry, "default_seq_len", None)
    errors = []
    for device in ("meta", "cpu"):
        try:
            with torch.random.fork_rng(devices=[]), torch.device(device):
                model = entry.build(**args)
            with torch.random.fork_rng(devices=[]):
                inputs, _ = entry.example_batch(EXPORT_BATCH, seq, device, **args)
            inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            c = cut_constraints(model, inputs)
            return ModelCuts(splittable=True, follow_consumers=c.follow_consumers, same_placement=c.same_placement)
        except Exception as e:  # noqa: BLE001 - export raises many types for code it cannot take
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            errors.append(f"{device}: {type(e).__name__}: {first[:200]}")
    log.info("model %s does not export (%s): only unsplit plans run it", spec.name, "; ".join(errors))
    return ModelCuts(splittable=False, reason=errors[-1])


# the code a model's cuts depend on: the models, their export and the rules read from it
CUTS_CODE = ("capture", "ir", "cut/split_export.py", "search/constraints.py")


def stored_model_cuts(spec: ModelSpec) -> ModelCuts:
    """model_cuts through the on-disk store of capture/cache.py: a model is exported once per
    machine, not once per command."""
    key = model_key("cuts", spec.name, spec.args, code=CUTS_CODE, seq_len=spec.seq_len)
    doc = load_json("cuts", key)
    if isinstance(doc, dict):
        try:
            return ModelCuts(
                splittable=bool(doc["splittable"]),
                follow_consumers=frozenset(doc["follow_consumers"]),
                same_placement=frozenset(tuple(p) for p in doc["same_placement"]),
                reason=str(doc["reason"]),
            )
        except (KeyError, TypeError, ValueError):
            pass  # damaged: export again
    cuts = model_cuts(spec)
    if not spec.name.startswith(IN_MEMORY_PREFIX):
        store_json(
            "cuts",
            key,
            {
                "splittable": cuts.splittable,
                "follow_consumers": sorted(cuts.follow_consumers),
                "same_placement": sorted(cuts.same_placement),
                "reason": cuts.reason,
            },
        )
    return cuts


class ConstraintCache:
    """ModelCuts per model (name, arguments, sequence length), the `max_entries` most
    recently used kept."""

    def __init__(self, max_entries: int = 16):
        self.max_entries = max_entries
        self._cuts: OrderedDict[str, ModelCuts] = OrderedDict()

    def get(self, spec: ModelSpec) -> ModelCuts:
        key = _key(spec)
        if key in self._cuts:
            self._cuts.move_to_end(key)
            return self._cuts[key]
        cuts = stored_model_cuts(spec)
        self._cuts[key] = cuts
        while len(self._cuts) > self.max_entries:
            self._cuts.popitem(last=False)
        return cuts

    def __len__(self) -> int:
        return len(self._cuts)


DEFAULT_CACHE = ConstraintCache()  # the planner's, when its caller passes none


def needs_split(groups_replicas: list[Any]) -> bool:
    """True when the groups do not all have the same replicas and shares (a split is needed)."""
    return any(r != groups_replicas[0] for r in groups_replicas[1:])


def violations(cuts: ModelCuts, group_of: dict[str, int], replicas_of_group: list[Any]) -> list[str]:
    """What of `cuts` a grouping with these placements breaks (empty: the executor runs it)."""
    out = []
    if not cuts.splittable and needs_split(replicas_of_group):
        out.append(f"the model cannot be split ({cuts.reason}), but the groups have different placements")
    for a, b in sorted(cuts.same_placement):
        if a in group_of and b in group_of and replicas_of_group[group_of[a]] != replicas_of_group[group_of[b]]:
            out.append(
                f"{a!r} and {b!r} pass a value without a sample dimension (a batch statistic) "
                f"but are placed differently"
            )
    return out
