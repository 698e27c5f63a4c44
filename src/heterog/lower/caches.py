"""What the lowering memoises per cost table, one named cache per piece, and the rule that
keeps them consistent.

The search lowers thousands of neighbouring plans against one CostTable; most blocks, moves
and buckets recur between them, so each module keeps what it derives here instead of
recomputing it. Entries that depend on the merged-device map (which symmetric devices are
simulated once) are keyed by a small int for it (`rep_id`): hashing a 1024-entry tuple per
block cost more than the caches saved. Those ints restart when too many maps were seen, and
every cache keyed by them is emptied at that moment, in `rep_id` — the one invalidation rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_REP_IDS = 10_000  # merged-device maps numbered before the numbers restart


@dataclass(slots=True)
class LoweringCaches:
    """Per-CostTable caches of the lowering (lower/*.py), each named for what it holds."""

    # keyed by rep_id: emptied whenever the numbers restart
    columns: dict[Any, Any] = field(default_factory=dict)  # tasks.py: a block's compute columns
    kept: dict[Any, Any] = field(default_factory=dict)  # columns.py: replicas a block keeps per placement
    buckets: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: a bucket's sync
    moves: dict[Any, Any] = field(default_factory=dict)  # transfers.py: a pair of blocks' moves and templates
    # keyed by the plan's own values
    replica: dict[Any, Any] = field(default_factory=dict)  # tasks.py: per-replica columns of a block
    splits: dict[Any, Any] = field(default_factory=dict)  # tasks.py: (size, placement) → samples per replica
    state: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: (nodes, served) → class → state
    classes: dict[Any, Any] = field(default_factory=dict)  # sync_tasks.py: device set → its devices' classes
    block_edges: dict[Any, Any] = field(default_factory=dict)  # blocks.py: a grouping's bytes between blocks
    p2p_pairs: dict[int, dict[Any, Any]] = field(default_factory=dict)  # blocks.py: per ClusterInfo (its id)
    _rep_ids: dict[tuple[int, ...], int] = field(default_factory=dict)

    def rep_id(self, rep: list[int]) -> int:
        """The number of the merged-device map `rep` (device → the device simulated for it)."""
        key = tuple(rep)
        hit = self._rep_ids.get(key)
        if hit is None:
            if len(self._rep_ids) >= MAX_REP_IDS:  # numbers restart: drop every entry keyed by an old one
                self._rep_ids.clear()
                for cache in (self.columns, self.kept, self.buckets, self.moves):
                    cache.clear()
            hit = self._rep_ids[key] = len(self._rep_ids)
        return hit
