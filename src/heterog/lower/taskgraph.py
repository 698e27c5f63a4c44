"""The task graph of one iteration as flat columns, and the bounded caches its builders share.

Task kinds: FWD and BWD (compute on a device), XFER (a re-partition transfer), SYNC (a
gradient collective), OPT (an optimizer step). Arrays are flat lists indexed by task id so the
event loops (lower/order.py, simulate/engine.py) touch no objects.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from heterog.lower.blocks import Block

FWD, BWD, XFER, SYNC, OPT = 0, 1, 2, 3, 4
KIND_NAMES = ("forward", "backward", "transfer", "sync", "optimizer")


class Tasks:
    """The task graph: flat per-task lists (task id = index); `comm` holds what only
    communication tasks have. Call `seal()` after the last task is added."""

    __slots__ = ("kind", "dur", "dev", "links", "succ", "npred", "key", "mb", "comm",
                 "mem_start", "mem_end", "link_bytes", "persistent_bytes",
                 "blocks", "stage_limit", "bwd_count", "rep", "initial_bytes", "core_bytes", "sources",
                 "xfer_blocks", "ties", "mb_stride", "_phase_stride", "_succ_csr", "_arrays")

    def __init__(self, blocks: list[Block], n_devices: int, num_microbatches: int):
        self.kind: list[int] = []
        self.dur: list[float] = []
        self.dev: list[int] = []                 # device of a compute task, -1 for communication
        self.links: list[tuple[int, ...]] = []   # links a communication task occupies
        self.succ: list[list[int]] = []
        self.npred = np.zeros(0, dtype=np.int64)     # inputs per task: filled by seal()
        self.sources = np.zeros(0, dtype=np.int64)   # tasks without inputs: idem
        self.key: list[int] = []                 # reference priority (see prio); -1 for communication
        self.mb: list[int] = []
        self.comm: dict[int, tuple[tuple[int, ...], float, int]] = {}  # t → (devices involved, bytes, block)
        self.mem_start: list = []                # [(device, +bytes), ...] or None
        self.mem_end: list = []
        self.link_bytes: dict[int, float] = {}
        self.persistent_bytes = [0.0] * n_devices   # parameters + gradients + optimizer state
        self.initial_bytes = [0.0] * n_devices      # memory in use when the iteration starts
        self.core_bytes: dict[int, float] = {}      # collective → bytes through a switch core
        self.blocks = blocks
        self.stage_limit = [1] * n_devices       # 1F1B: micro-batches in flight per device
        self.bwd_count: dict[tuple[int, int], int] = {}
        self.rep: list[int] = list(range(n_devices))  # device whose tasks stand for this one's
        self.xfer_blocks: dict[int, tuple[int, int]] = {}   # transfer → (producer, consumer block)
        self.ties: dict[int, str] = {}           # sync of a tied parameter's copies → the parameter
        self.mb_stride = 2 * len(blocks) + 1     # key step of one micro-batch
        self._phase_stride = (num_microbatches + 1) * self.mb_stride
        self._succ_csr: tuple[np.ndarray, np.ndarray] | None = None
        self._arrays: dict[str, np.ndarray] = {}

    def prio(self, phase: int, mb: int, signed_block: int) -> int:
        """The priority key of a compute task: (phase, micro-batch, ±block) in lexicographic
        order as one int (smaller first), so the list scheduler compares ints, not tuples."""
        return phase * self._phase_stride + mb * self.mb_stride + signed_block + len(self.blocks)

    def add(self, kind: int, dur: float, dev: int, key: int, mb: int) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.dur.append(dur)
        self.dev.append(dev)
        self.links.append(())
        self.succ.append([])
        self.key.append(key)
        self.mb.append(mb)
        self.mem_start.append(None)
        self.mem_end.append(None)
        return t

    def add_comm(self, kind: int, dur: float, mb: int, block: int, links: tuple[int, ...],
                 members: tuple[int, ...], nbytes: float) -> int:
        t = self.add(kind, dur, -1, -1, mb)
        self.links[t] = links
        self.comm[t] = (members, nbytes, block)
        return t

    def block_of(self, t: int) -> int:
        if self.dev[t] < 0:
            return self.comm[t][2]
        return abs(self.key[t] % self.mb_stride - len(self.blocks))

    def dep(self, a: int, b: int) -> None:
        self.succ[a].append(b)

    def mem(self, t: int, start: bool, dev: int, delta: float) -> None:
        # a new list: expand shares memory-effect lists between tasks (cached block columns,
        # replicated micro-batches), so none is changed in place
        lst = self.mem_start if start else self.mem_end
        old = lst[t]
        lst[t] = [(dev, delta)] if old is None else old + [(dev, delta)]

    def succ_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The successor lists as compressed rows (pointer, index) for the compiled loops;
        built once after seal()."""
        if self._succ_csr is None:
            self._succ_csr = compressed_rows(len(self.succ), self.succ)
        return self._succ_csr

    def array(self, column: str) -> np.ndarray:
        """A numeric column ('dur', 'dev', 'kind', 'mb', 'key') as a numpy array, made once
        after seal(): the list scheduler and the timed pass both read dur and dev."""
        a = self._arrays.get(column)
        if a is None:
            dtype = np.float64 if column == "dur" else np.int64
            a = self._arrays[column] = np.asarray(getattr(self, column), dtype=dtype)
        return a

    def seal(self) -> None:
        self.npred = np.bincount(self.succ_csr()[1], minlength=len(self.kind)).astype(np.int64)
        self.sources = np.flatnonzero(self.npred == 0).astype(np.int64)   # tasks with no inputs, in id order


def compressed_rows(n: int, rows: list, tids: list[int] | None = None, *,
                    arrays: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Integer rows of tasks as (pointer, index) arrays over all n tasks: row t is
    index[pointer[t]:pointer[t + 1]]. `rows` belong to the tasks `tids` (increasing; all
    tasks in order when None); the other tasks have empty rows. arrays: the rows are int64
    numpy arrays (joined at C speed)."""
    length = np.zeros(n, dtype=np.int64)
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if tids is None:
        length[:] = counts
    else:
        length[tids] = counts
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length, out=ptr[1:])
    if arrays:
        return ptr, np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return ptr, np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(ptr[-1]))


_CACHED_REPLICAS = 200_000   # replicas' entries kept in a per-call-shared cache (~100 MB at most)


def rep_id(scratch: dict, rep: list[int]) -> int:
    """A small int for the merged-device map `rep`, a key of the caches below: hashing a
    1024-entry tuple for every block cost more than the caches saved."""
    ids = scratch.setdefault("rep_ids", {})
    rt = tuple(rep)
    hit = ids.get(rt)
    if hit is None:
        if len(ids) >= 10_000:    # ids restart: drop every entry keyed by an old one
            ids.clear()
            scratch.pop("columns", None)
            scratch.pop("buffers", None)
        hit = ids[rt] = len(ids)
    return hit


def make_room(cache: dict, replicas: int) -> None:
    """Bound a cache of per-replica lists by the replicas it holds, not by its entries: an
    entry of a 1024-device placement weighs as much as 16 of a 64-device one. The count is
    kept in the cache under the key None."""
    held = cache.get(None, 0) + replicas
    if held > _CACHED_REPLICAS:
        cache.clear()
        held = replicas
    cache[None] = held
