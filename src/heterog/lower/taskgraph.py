"""The task graph of one iteration as flat columns, and the bounded caches its builders share.

Task kinds: FWD and BWD (compute on a device), XFER (a re-partition transfer), SYNC (a
gradient collective), OPT (an optimizer step). Per-task columns are flat lists indexed by task
id; a task's successors and memory effects are rows of TaskRows, added as numpy chunks where a
block adds many at once; the compiled loops (lower/order.py, simulate/engine.py) read them as
arrays and touch no objects.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from heterog._jit import njit
from heterog.lower.blocks import Block

FWD, BWD, XFER, SYNC, OPT = 0, 1, 2, 3, 4
KIND_NAMES = ("forward", "backward", "transfer", "sync", "optimizer")


class Tasks:
    """The task graph: flat per-task lists (task id = index); `comm` holds what only
    communication tasks have. Call `seal()` after the last task is added."""

    __slots__ = (
        "kind",
        "dur",
        "dev",
        "links",
        "edges",
        "npred",
        "key",
        "mb",
        "comm",
        "mem_start",
        "mem_end",
        "sync_loads",
        "persistent_bytes",
        "blocks",
        "stage_limit",
        "bwd_count",
        "rep",
        "initial_bytes",
        "core_bytes",
        "sources",
        "xfer_blocks",
        "ties",
        "shard_ops",
        "mb_stride",
        "link_sets",
        "runs",
        "dur_patches",
        "_phase_stride",
        "_succ_csr",
        "_arrays",
    )

    def __init__(self, blocks: list[Block], n_devices: int, num_microbatches: int):
        self.kind: list[int] = []
        self.dur: list[float] = []
        self.dev: list[int] = []  # device of a compute task, -1 for communication
        self.links: list[tuple[int, ...]] = []  # links a communication task occupies
        self.edges = TaskRows((np.int64,), (True,))  # task → successor
        self.npred = np.zeros(0, dtype=np.int64)  # inputs per task: filled by seal()
        self.sources = np.zeros(0, dtype=np.int64)  # tasks without inputs: idem
        self.key: list[int] = []  # reference priority (see prio); -1 for communication
        self.mb: list[int] = []
        self.comm: dict[int, tuple[tuple[int, ...], float, int]] = {}  # t → (devices involved, bytes, block)
        self.mem_start = effects()  # memory effects at a task's start
        self.mem_end = effects()  # ... and at its end
        self.sync_loads: dict[int, dict[int, float]] = {}  # collective → link → bytes per buffer byte
        self.persistent_bytes = [0.0] * n_devices  # parameters + gradients + optimizer state
        self.initial_bytes = [0.0] * n_devices  # memory in use when the iteration starts
        self.core_bytes: dict[int, float] = {}  # collective → bytes through a switch core
        self.blocks = blocks
        self.stage_limit = [1] * n_devices  # 1F1B: micro-batches in flight per device
        self.bwd_count: dict[tuple[int, int], int] = {}
        self.rep: list[int] = list(range(n_devices))  # device whose tasks stand for this one's
        self.xfer_blocks: dict[int, tuple[int, int]] = {}  # transfer → (producer, consumer block)
        self.ties: dict[int, str] = {}  # sync of a tied parameter's copies → the parameter
        self.shard_ops: dict[int, ShardOp] = {}  # a sharded block's reduce-scatter or all-gather (shard_tasks.py)
        self.mb_stride = 2 * len(blocks) + 1  # key step of one micro-batch
        self._phase_stride = (num_microbatches + 1) * self.mb_stride
        self._succ_csr: tuple[np.ndarray, np.ndarray] | None = None
        self._arrays: dict[str, np.ndarray] = {}
        # runs of tasks whose columns exist as arrays: (first id, end id, ComputeRun |
        # TransferRun | CopyRun); array() takes them from there, not from the lists
        self.runs: list[tuple] = []
        # durations set once every micro-batch is expanded — micro-batch 0's backwards, which
        # create the gradients the copies of it add into (tasks.py): (first id, durations)
        self.dur_patches: list[tuple[int, np.ndarray]] = []
        # the communication tasks that hold links and their link sets, made once per
        # schedule for the timed pass (simulate/engine.py comm_link_sets)
        self.link_sets: tuple | None = None

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
        self.key.append(key)
        self.mb.append(mb)
        return t

    def add_comm(
        self,
        kind: int,
        dur: float,
        mb: int,
        block: int,
        links: tuple[int, ...],
        members: tuple[int, ...],
        nbytes: float,
    ) -> int:
        t = self.add(kind, dur, -1, -1, mb)
        self.links[t] = links
        self.comm[t] = (members, nbytes, block)
        return t

    def add_sync(
        self,
        dur: float,
        mb: int,
        block: int,
        links: tuple[int, ...],
        load: dict[int, float],
        members: tuple[int, ...],
        nbytes: float,
        cores,
    ) -> int:
        """A collective task holding `links`, with each link's load (bytes per buffer byte)
        and the bytes it pushes through the switch cores among them (`cores`: ClusterInfo.shared_bw)."""
        t = self.add_comm(SYNC, dur, mb, block, links, members, nbytes)
        for link in cores:
            if link in load:  # a ring crosses the core once per node it leaves
                self.core_bytes[t] = load[link] * nbytes
        self.sync_loads[t] = load
        return t

    def block_of(self, t: int) -> int:
        if self.dev[t] < 0:
            return self.comm[t][2]
        return abs(self.key[t] % self.mb_stride - len(self.blocks))

    def dep(self, a: int, b: int) -> None:
        self.edges.task.append(a)
        self.edges.values[0].append(b)

    def mem(self, t: int, start: bool, dev: int, delta: float) -> None:
        (self.mem_start if start else self.mem_end).add(t, dev, delta)

    def succ_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The successor lists as compressed rows (pointer, index) for the compiled loops;
        built once after seal()."""
        if self._succ_csr is None:
            src, dst = self.edges.arrays()
            ptr = np.zeros(len(self.kind) + 1, dtype=np.int64)
            np.cumsum(np.bincount(src, minlength=len(self.kind)), out=ptr[1:])
            self._succ_csr = ptr, dst
        return self._succ_csr

    def successors(self, t: int) -> list[int]:
        ptr, idx = self.succ_csr()
        return idx[ptr[t] : ptr[t + 1]].tolist()

    def array(self, column: str) -> np.ndarray:
        """A numeric column ('dur', 'dev', 'kind', 'mb', 'key') as a numpy array, made once
        after seal(): the list scheduler and the timed pass both read dur and dev. Runs of
        tasks added from cached arrays (self.runs) are copied from them, the rest converted
        from the list: converting 100 000 list entries cost ~40 ns each."""
        a = self._arrays.get(column)
        if a is None:
            values = getattr(self, column)
            a = np.empty(len(values), dtype=np.float64 if column == "dur" else np.int64)
            at = 0
            for first, end, run in self.runs:
                if first > at:
                    a[at:first] = values[at:first]
                run.fill(a, column, first, end)
                at = end
            a[at:] = values[at:]
            if column == "dur":
                for first, dur in self.dur_patches:
                    a[first : first + len(dur)] = dur
            self._arrays[column] = a
        return a

    def seal(self) -> None:
        """Derive the inputs per task (again, when tasks were added since: shard_tasks.py)."""
        self._succ_csr, self._arrays = None, {}
        self.npred = np.bincount(self.succ_csr()[1], minlength=len(self.kind)).astype(np.int64)
        self.sources = np.flatnonzero(self.npred == 0).astype(np.int64)  # tasks with no inputs, in id order


class ShardOp(NamedTuple):
    """What a sharded block's collective task does (lower/shard_tasks.py): the operation, its
    members (device ids, ring order) with each one's fraction of the flat buffer, and, for a
    stage-3 gather or a per-micro-batch reduce-scatter, the compute it serves (phase, micro-batch)."""

    primitive: str  # CollectiveOp
    members: tuple[int, ...]
    fractions: tuple[float, ...]
    phase: str | None = None  # Phase
    microbatch: int | None = None


class ComputeRun(NamedTuple):
    """A block's forwards then backwards in one micro-batch (tasks.py BlockColumns)."""

    dur: np.ndarray
    dev: np.ndarray
    kind: np.ndarray
    key_forward: int
    key_backward: int
    mb: int

    def fill(self, a: np.ndarray, column: str, first: int, end: int) -> None:
        if column == "key":
            half = first + (end - first) // 2
            a[first:half], a[half:end] = self.key_forward, self.key_backward
        elif column == "mb":
            a[first:end] = self.mb
        else:
            a[first:end] = getattr(self, column)


class TransferRun(NamedTuple):
    """A pair of blocks' transfers in one micro-batch (transfers.py PairTransfers)."""

    dur: np.ndarray
    mb: int

    def fill(self, a: np.ndarray, column: str, first: int, end: int) -> None:
        if column == "dur":
            a[first:end] = self.dur
        elif column == "kind":
            a[first:end] = XFER
        else:
            a[first:end] = self.mb if column == "mb" else -1


class CopyRun(NamedTuple):
    """A replicated micro-batch: the columns of an earlier run of tasks (tasks.py _replicate),
    its compute tasks' keys shifted by `key_shift`."""

    source: int
    key_shift: int
    mb: int

    def fill(self, a: np.ndarray, column: str, first: int, end: int) -> None:
        src = a[self.source : self.source + end - first]
        if column == "key":
            a[first:end] = src + self.key_shift * (src >= 0)
        elif column == "mb":
            a[first:end] = self.mb
        else:
            a[first:end] = src


class TaskRows:
    """Rows that belong to tasks — a task's memory effects, its successors — as flat columns:
    the task, then value columns. Whole runs come as numpy chunks (a block's compute tasks,
    whose rows are cached per block; a bucket's backwards before its sync); single rows are
    appended one by one. A task's rows keep the order in which they were added: the order in
    which a device's effects at one instant are applied, and in which the list scheduler
    releases successors (lower/order.py), so it is part of the result."""

    __slots__ = ("chunks", "task", "values", "_ids", "_dtypes", "_by_task")

    def __init__(self, dtypes: tuple, ids: tuple[bool, ...]):
        # per chunk: (single rows added before it, task id offset, (tasks, *values)); the
        # offset is applied when the rows are read, so a chunk is reused as it is
        self.chunks: list[tuple[int, int, tuple[np.ndarray, ...], int]] = []  # ..., rows
        self.task: list[int] = []
        self.values: tuple[list, ...] = tuple([] for _ in dtypes)
        self._ids = (True,) + ids  # columns holding task ids (shifted with the task)
        self._dtypes = (np.int64,) + tuple(dtypes)
        self._by_task: dict[int, list[tuple]] | None = None

    def add(self, t: int, *values) -> None:
        self.task.append(t)
        for col, v in zip(self.values, values):
            col.append(v)

    def add_chunk(self, first_task: int, chunk: tuple[np.ndarray, ...]) -> int:
        """Add a chunk (task ids relative to first_task: a cached chunk is reused at every
        place); returns its index."""
        self.chunks.append((len(self.task), first_task, chunk, len(chunk[0])))
        return len(self.chunks) - 1

    def replace_chunk(self, i: int, first_task: int, chunk: tuple[np.ndarray, ...]) -> None:
        self.chunks[i] = (self.chunks[i][0], first_task, chunk, len(chunk[0]))

    def mark(self) -> tuple[int, int]:
        """Where the rows added from now on begin (a micro-batch's segment, see segment)."""
        return len(self.chunks), len(self.task)

    def segment(self, since: tuple[int, int], until: tuple[int, int]) -> tuple[np.ndarray, ...]:
        """The rows added between two marks as one chunk (ids as they are), in the order
        added: a replicated micro-batch adds it again with its id offset (see add_chunk)."""
        return self._ordered(since, until)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Every row as columns (task, *values), by task, each task's in the order added."""
        cols = self.in_order()
        order = stable_by_task(cols[0])
        return tuple(c[order] for c in cols)

    def in_order(self) -> tuple[np.ndarray, ...]:
        """Every row as columns (task, *values), in the order added."""
        return self._ordered((0, 0), self.mark())

    def _ordered(self, since: tuple[int, int], until: tuple[int, int]) -> tuple[np.ndarray, ...]:
        """The rows between two marks as columns with task ids applied, in the order added."""
        (c0, s0), (c1, s1) = since, until
        singles = tuple(np.array(c[s0:s1], dtype=dt) for c, dt in zip((self.task,) + self.values, self._dtypes))
        parts, offsets, lengths, at = [], [], [], s0
        for pos, first, chunk, n in self.chunks[c0:c1]:
            if pos > at:
                parts.append(tuple(c[at - s0 : pos - s0] for c in singles))
                offsets.append(0)
                lengths.append(pos - at)
                at = pos
            parts.append(chunk)
            offsets.append(first)
            lengths.append(n)
        parts.append(tuple(c[at - s0 :] for c in singles))
        offsets.append(0)
        lengths.append(s1 - at)
        cols = [np.concatenate(c) for c in zip(*parts)]
        shift = np.repeat(np.array(offsets, dtype=np.int64), lengths)
        for c, is_id in zip(cols, self._ids):
            if is_id:
                c += shift
        return tuple(cols)

    def of(self, t: int) -> list[tuple]:
        """Task t's rows as value tuples, in order (for the Program's writer; built once)."""
        if self._by_task is None:
            self._by_task = {}
            task, *values = self.arrays()
            for k, *v in zip(task.tolist(), *(c.tolist() for c in values)):
                self._by_task.setdefault(k, []).append(tuple(v))
        return self._by_task.get(t, [])


@njit(cache=True, nogil=True)
def stable_by_task(task):
    """The permutation that groups rows by task id, keeping their order within a task (a
    counting sort: linear, where a comparison sort cost as much as the rest of the replay)."""
    n_tasks = task.max() + 1 if len(task) else 0
    start = np.zeros(n_tasks + 1, dtype=np.int64)
    for t in task:
        start[t + 1] += 1
    for i in range(n_tasks):
        start[i + 1] += start[i]
    order = np.empty(len(task), dtype=np.int64)
    for i in range(len(task)):
        t = task[i]
        order[start[t]] = i
        start[t] += 1
    return order


def effects() -> TaskRows:
    """Memory effects of one kind (at task starts, or at ends): task, device, bytes (+
    allocated, − freed)."""
    return TaskRows((np.int64, np.float64), (False, False))


_CACHED_REPLICAS = 200_000  # replicas' entries kept in a per-call-shared cache (~100 MB at most)


def make_room(cache: dict, replicas: int) -> None:
    """Bound a cache of per-replica lists by the replicas it holds, not by its entries: an
    entry of a 1024-device placement weighs as much as 16 of a 64-device one. The count is
    kept in the cache under the key None."""
    held = cache.get(None, 0) + replicas
    if held > _CACHED_REPLICAS:
        cache.clear()
        held = replicas
    cache[None] = held
