"""The timed simulation of one iteration: the Program's order (lower/order.py) with times.

A compute task starts when its inputs are ready and the task before it on its device has
ended; a transfer or collective starts when its inputs are ready and the task before it on
every link it occupies has ended, and holds all of them for its whole (uncontended) time.
Links are therefore FIFO and exclusive: two transfers sharing a NIC take twice as long as one.
An oversubscribed switch core is the exception: a pipe that moves the bytes of the transfers
crossing it one after another at its bandwidth, while their NIC parts overlap.

Because every queue (device, link, switch core) follows the fixed order and that order lists
each task after its inputs, the order is a topological order of the graph plus the queue
edges: one pass over it gives every start time as a max of sums of durations (a max-plus
system, lower/order.py), with no event queue. Memory is then replayed from the start and end
times: the effects of all tasks, sorted by time (ends before starts at the same instant, as a
device frees a task's memory before its next task allocates).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
from numba import njit

from heterog.lower.taskgraph import Tasks, compressed_rows


def run(tasks: Tasks, order: list[int], n_devices: int,
        capacity_bytes: list[int], record: bool, shared_bw: dict[int, float] | None = None):
    """Timed simulation following `order`. Returns (start, end, peak, overflow, mem_trace)
    with overflow = (device, time) of the first device to exceed its memory, or None, and
    mem_trace per device [(time, bytes in use)] when `record`.

    shared_bw: switch-core links. The core is a pipe that moves bytes at its bandwidth in the
    fixed order, alongside the NICs: a transfer that crosses it ends no earlier than its own
    time and than the core has pushed its bytes after those of the transfers before it. Two
    transfers on disjoint NICs thus overlap fully under a fast core and share a slow one."""
    start, end = _times(tasks, order, n_devices, shared_bw or {})
    peak, overflow, trace = _memory(tasks, start, end, n_devices, capacity_bytes, record)
    return start.tolist(), end.tolist(), peak, overflow, trace


def _times(tasks: Tasks, order: list[int], n_devices: int, shared_bw: dict[int, float]):
    """Start and end of every task (numpy arrays): one pass over the fixed order (see the
    module docstring), compiled."""
    cls_ptr, cls_idx, n_classes, core_ptr, core_idx, core_bytes = _resources(tasks, shared_bw)
    succ_ptr, succ_idx = tasks.succ_csr()
    return _timed_pass(np.asarray(order, dtype=np.int64), tasks.array("dur"), tasks.array("dev"),
                       succ_ptr, succ_idx, cls_ptr, cls_idx,
                       core_ptr, core_idx, core_bytes, np.array(list(shared_bw.values()), dtype=np.float64),
                       n_devices, n_classes)


@njit(cache=True, nogil=True)
def _timed_pass(order, dur, dev, succ_ptr, succ_idx, cls_ptr, cls_idx, core_ptr, core_idx, core_bytes,
                core_bw, n_devices, n_classes):
    """The timed pass: a compute task waits for its inputs and its device; a transfer or
    collective for its inputs and every link class it holds, then holds them to its end; one
    that crosses switch cores starts no earlier than the cores' previous transfer started and
    ends no earlier than the cores have pushed its bytes after those before it."""
    n = len(dur)
    ready = np.zeros(n)               # when the inputs of a task are all done
    start = np.zeros(n)
    end = np.zeros(n)
    dev_free = np.zeros(n_devices)    # end of the device's previous task
    link_free = np.zeros(n_classes)   # end of the link class's previous task
    core_started = np.zeros(len(core_bw))   # start of the core's previous transfer
    core_free = np.zeros(len(core_bw))      # when the core has pushed the bytes before
    for t in order:
        s = ready[t]
        d = dev[t]
        if d >= 0:
            s = max(s, dev_free[d])
            e = s + dur[t]
            dev_free[d] = e
        else:
            for j in range(cls_ptr[t], cls_ptr[t + 1]):
                s = max(s, link_free[cls_idx[j]])
            for j in range(core_ptr[t], core_ptr[t + 1]):
                s = max(s, core_started[core_idx[j]])
            e = s + dur[t]
            for j in range(core_ptr[t], core_ptr[t + 1]):
                c = core_idx[j]
                core_started[c] = s
                core_free[c] = max(s, core_free[c]) + core_bytes[t] / core_bw[c]
                e = max(e, core_free[c])
            for j in range(cls_ptr[t], cls_ptr[t + 1]):
                link_free[cls_idx[j]] = e
        start[t] = s
        end[t] = e
        for j in range(succ_ptr[t], succ_ptr[t + 1]):
            u = succ_idx[j]
            ready[u] = max(ready[u], e)
    return start, end


def _resources(tasks: Tasks, shared_bw: dict[int, float]):
    """Per task, as compressed rows: the link classes it holds (links that serve exactly the
    same tasks merged: with fixed orders they act as one, e.g. the ~2300 links of a
    1024-device ring), and the switch cores it crosses (index into shared_bw) with the bytes
    it pushes through them. Returns (class rows, number of classes, core rows, core bytes)."""
    links = tasks.links
    n = len(links)
    comm_ids = sorted(t for t in tasks.comm if links[t])
    core_index = {l: i for i, l in enumerate(shared_bw)}
    paths: dict[tuple[int, ...], tuple[int, ...]] = {}    # link set → its exclusive links
    cores: dict[tuple[int, ...], tuple[int, ...]] = {}    # link set → its switch cores
    for t in comm_ids:
        lk = links[t]
        if lk not in paths:
            cores[lk] = tuple(core_index[l] for l in lk if l in core_index)
            paths[lk] = tuple(l for l in lk if l not in core_index) if cores[lk] else lk
    member_of: dict[int, list[int]] = {}
    excl = list(paths.values())
    for pi, path in enumerate(excl):
        for l in path:
            lst = member_of.get(l)
            if lst is None:
                member_of[l] = [pi]
            else:
                lst.append(pi)
    class_of_key: dict[tuple[int, ...], int] = {}
    class_of_link = {l: class_of_key.setdefault(tuple(pis), len(class_of_key)) for l, pis in member_of.items()}
    classes_of_path = {lk: tuple(sorted({class_of_link[l] for l in ex})) for lk, ex in zip(paths, excl)}
    cls_ptr, cls_idx = compressed_rows(n, [classes_of_path[links[t]] for t in comm_ids], comm_ids)
    core_ids = [t for t in comm_ids if cores[links[t]]]
    core_ptr, core_idx = compressed_rows(n, [cores[links[t]] for t in core_ids], core_ids)
    core_bytes = np.zeros(n)
    for t in core_ids:
        core_bytes[t] = tasks.core_bytes.get(t, tasks.comm[t][1])
    return cls_ptr, cls_idx, len(class_of_key), core_ptr, core_idx, core_bytes


def _memory(tasks: Tasks, start: np.ndarray, end: np.ndarray, n_devices: int,
            capacity_bytes: list[int], record: bool):
    """Replay every task's memory effects in time order: (peak per device, first overflow
    (device, time) or None, per-device trace when `record`)."""
    initial = list(tasks.initial_bytes)
    overflow = next(((d, 0.0) for d in range(n_devices) if initial[d] > capacity_bytes[d]), None)
    parts = [_effects(effects, when, phase) for phase, effects, when in
             ((1, tasks.mem_start, start), (0, tasks.mem_end, end))]
    if not any(len(p[0]) for p in parts):
        trace = [[(0.0, initial[d])] if initial[d] else [] for d in range(n_devices)] if record else None
        return initial, overflow, trace
    time_a, dev_a, delta_a, phase_a = (np.concatenate(c) for c in zip(*parts))
    idx = np.lexsort((phase_a, time_a, dev_a))      # stable: equal events keep task order
    dev_s, time_s, phase_s = dev_a[idx], time_a[idx], phase_a[idx]
    cum = np.cumsum(delta_a[idx])
    first = np.flatnonzero(np.r_[True, dev_s[1:] != dev_s[:-1]])
    before = np.r_[0.0, cum[first[1:] - 1]]                  # running sum before each device's events
    counts = np.diff(np.r_[first, len(dev_s)])
    init_a = np.array(initial, dtype=float)
    cur = cum - np.repeat(before, counts) + init_a[dev_s]
    peak = initial[:]
    for d, p in zip(dev_s[first].tolist(), np.maximum.reduceat(cur, first).tolist()):
        if p > peak[d]:
            peak[d] = p
    if overflow is None:
        over = np.flatnonzero(cur > np.asarray(capacity_bytes, dtype=float)[dev_s])
        if len(over):
            i = over[np.lexsort((phase_s[over], time_s[over]))[0]]
            overflow = (int(dev_s[i]), float(time_s[i]))
    trace = None
    if record:
        trace = [[(0.0, initial[d])] if initial[d] else [] for d in range(n_devices)]
        for d, a, b in zip(dev_s[first].tolist(), first.tolist(), (first + counts).tolist()):
            trace[d].extend(zip(time_s[a:b].tolist(), cur[a:b].tolist()))
    return peak, overflow, trace


def _effects(effects: list, when: np.ndarray, phase: int):
    """The memory effects of one kind (at starts or at ends) as arrays: time, device, bytes, phase."""
    lists = [e or () for e in effects]      # None: a task without effects
    counts = np.fromiter(map(len, lists), dtype=np.intp, count=len(lists))
    # (device, bytes) pairs flattened into one float array: device numbers are exact in floats
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(lists)), dtype=float, count=2 * int(counts.sum()))
    times = np.repeat(when, counts)
    return times, flat[0::2].astype(np.intp), flat[1::2], np.full(len(times), phase, dtype=np.intp)
