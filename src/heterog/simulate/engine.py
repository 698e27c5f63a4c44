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

import numpy as np

from heterog._jit import njit
from heterog.lower.context import ClusterInfo
from heterog.lower.taskgraph import Tasks, stable_by_task


def run(tasks: Tasks, order: np.ndarray, info: ClusterInfo, record: bool):
    """Timed simulation following `order` on the cluster `info` describes. Returns (start,
    end, peak, overflow, mem_trace) with overflow = (device, time) of the first device to
    exceed its memory, or None, and mem_trace per device [(time, bytes in use)] when `record`.

    Switch cores (info.shared_bw) are pipes that move bytes at their bandwidth in the fixed
    order, alongside the NICs: a transfer that crosses one ends no earlier than its own time
    and than the core has pushed its bytes after those of the transfers before it. Two
    transfers on disjoint NICs thus overlap fully under a fast core and share a slow one."""
    n_devices = len(info.devices)
    start, end = _times(tasks, order, info)
    peak, overflow, trace = _memory(tasks, start, end, n_devices, info.capacity_bytes, record)
    return start.tolist(), end.tolist(), peak, overflow, trace


def _times(tasks: Tasks, order: np.ndarray, info: ClusterInfo):
    """Start and end of every task (numpy arrays): one pass over the fixed order (see the
    module docstring), compiled where numba can be imported (heterog/_jit.py)."""
    link_ptr, link_idx, core_ptr, core_idx, core_bytes = _resources(tasks, info)
    succ_ptr, succ_idx = tasks.succ_csr()
    return _timed_pass(
        np.asarray(order, dtype=np.int64),
        tasks.array("dur"),
        tasks.array("dev"),
        succ_ptr,
        succ_idx,
        link_ptr,
        link_idx,
        core_ptr,
        core_idx,
        core_bytes,
        np.array(list(info.shared_bw.values()), dtype=np.float64),
        len(info.devices),
        len(info.links),
    )


@njit(cache=True, nogil=True)
def _timed_pass(
    order, dur, dev, succ_ptr, succ_idx, link_ptr, link_idx, core_ptr, core_idx, core_bytes, core_bw, n_devices, n_links
):
    """The timed pass: a compute task waits for its inputs and its device; a transfer or
    collective for its inputs and every link it holds, then holds them to its end; one
    that crosses switch cores starts no earlier than the cores' previous transfer started and
    ends no earlier than the cores have pushed its bytes after those before it."""
    n = len(dur)
    ready = np.zeros(n)  # when the inputs of a task are all done
    start = np.zeros(n)
    end = np.zeros(n)
    dev_free = np.zeros(n_devices)  # end of the device's previous task
    link_free = np.zeros(n_links)  # end of the link's previous task
    core_started = np.zeros(len(core_bw))  # start of the core's previous transfer
    core_free = np.zeros(len(core_bw))  # when the core has pushed the bytes before
    for t in order:
        s = ready[t]
        d = dev[t]
        if d >= 0:
            s = max(s, dev_free[d])
            e = s + dur[t]
            dev_free[d] = e
        else:
            for j in range(link_ptr[t], link_ptr[t + 1]):
                s = max(s, link_free[link_idx[j]])
            for j in range(core_ptr[t], core_ptr[t + 1]):
                s = max(s, core_started[core_idx[j]])
            e = s + dur[t]
            for j in range(core_ptr[t], core_ptr[t + 1]):
                c = core_idx[j]
                core_started[c] = s
                core_free[c] = max(s, core_free[c]) + core_bytes[t] / core_bw[c]
                e = max(e, core_free[c])
            for j in range(link_ptr[t], link_ptr[t + 1]):
                link_free[link_idx[j]] = e
        start[t] = s
        end[t] = e
        for j in range(succ_ptr[t], succ_ptr[t + 1]):
            u = succ_idx[j]
            ready[u] = max(ready[u], e)
    return start, end


def _resources(tasks: Tasks, info: ClusterInfo):
    """Per communication task, as compressed rows: the links it holds exclusively and the
    switch cores it crosses (index into shared_bw), with the bytes it pushes through them.
    Returns (link rows, core rows, core bytes)."""
    n = len(tasks.links)
    comm_ids, sets = comm_link_sets(tasks, info)
    link_ptr, link_idx = info.link_sets.rows(n, comm_ids, sets, info.link_sets.EXCLUSIVE)
    core_ptr, core_idx = info.link_sets.rows(n, comm_ids, sets, info.link_sets.CORES)
    core_bytes = np.zeros(n)
    for t in np.flatnonzero(np.diff(core_ptr)).tolist():
        core_bytes[t] = tasks.core_bytes.get(t, tasks.comm[t][1])
    return link_ptr, link_idx, core_ptr, core_idx, core_bytes


def comm_link_sets(tasks: Tasks, info: ClusterInfo) -> tuple[np.ndarray, np.ndarray]:
    """The communication tasks that hold links, in id order, and their link sets' numbers
    (info.link_sets), made once per schedule."""
    hit = tasks.link_sets
    if hit is None or hit[0] != info.link_sets.generation:
        links = tasks.links
        comm_ids = [t for t in sorted(tasks.comm) if links[t]]
        sets = info.link_sets.ids([links[t] for t in comm_ids])
        hit = tasks.link_sets = (info.link_sets.generation, np.array(comm_ids, dtype=np.int64), sets)
    return hit[1], hit[2]


def _memory(tasks: Tasks, start: np.ndarray, end: np.ndarray, n_devices: int, capacity_bytes: list[int], record: bool):
    """Replay every task's memory effects in time order: (peak per device, first overflow
    (device, time) or None, per-device trace when `record`)."""
    initial = list(tasks.initial_bytes)
    overflow = next(((d, 0.0) for d in range(n_devices) if initial[d] > capacity_bytes[d]), None)
    # ends first: at equal times a device frees a task's memory before its next task allocates
    dev_s, time_s, phase_s, delta_s = _events_in_order(
        *tasks.mem_end.in_order(), *tasks.mem_start.in_order(), start, end, n_devices
    )
    if not len(time_s):
        trace = [[(0.0, initial[d])] if initial[d] else [] for d in range(n_devices)] if record else None
        return initial, overflow, trace
    init_a = np.array(initial, dtype=float)
    cur, peak_a, over = _replay(dev_s, time_s, phase_s, delta_s, init_a, np.asarray(capacity_bytes, dtype=float))
    peak = [max(p, i) for p, i in zip(peak_a.tolist(), initial)]
    if overflow is None and over >= 0:
        overflow = (int(dev_s[over]), float(time_s[over]))
    trace = None
    if record:
        trace = [[(0.0, initial[d])] if initial[d] else [] for d in range(n_devices)]
        first = np.flatnonzero(np.r_[True, dev_s[1:] != dev_s[:-1]])
        for d, a, b in zip(dev_s[first].tolist(), first.tolist(), np.r_[first[1:], len(dev_s)].tolist()):
            trace[d].extend(zip(time_s[a:b].tolist(), cur[a:b].tolist()))
    return peak, overflow, trace


@njit(cache=True, nogil=True)
def _events_in_order(e_task, e_dev, e_delta, s_task, s_dev, s_delta, start, end, n_devices):
    """Memory events (ends at their task's end, starts at its start), ordered by device, then
    time, ends before starts, then task, then the order added: (device, time, phase — 0 an
    end —, bytes) per event. Counting sorts by task and device, then a stable sort by time
    within each device."""
    ne, ns = len(e_task), len(s_task)
    n = ne + ns
    dev = np.empty(n, dtype=np.int64)
    time = np.empty(n)
    delta = np.empty(n)
    phase = np.empty(n, dtype=np.int8)
    by_task = stable_by_task(e_task)
    for k in range(ne):
        i = by_task[k]
        dev[k], time[k], delta[k], phase[k] = e_dev[i], end[e_task[i]], e_delta[i], 0
    by_task = stable_by_task(s_task)
    for k in range(ns):
        i = by_task[k]
        dev[ne + k], time[ne + k], delta[ne + k], phase[ne + k] = s_dev[i], start[s_task[i]], s_delta[i], 1
    first = np.zeros(n_devices + 1, dtype=np.int64)
    for d in dev:
        first[d + 1] += 1
    for d in range(n_devices):
        first[d + 1] += first[d]
    order = np.empty(n, dtype=np.int64)
    at = first[:-1].copy()
    for i in range(n):
        order[at[dev[i]]] = i
        at[dev[i]] += 1
    for d in range(n_devices):
        a, b = first[d], first[d + 1]
        if b - a > 1:
            seg = order[a:b]
            order[a:b] = seg[np.argsort(time[seg], kind="mergesort")]
    return dev[order], time[order], phase[order], delta[order]


@njit(cache=True, nogil=True)
def _replay(dev_s, time_s, phase_s, delta_s, initial, capacity):
    """Bytes in use after each event (events sorted by device, then time), each device's
    peak (-inf where it has no events), and the index of the first event, in (time, end before
    start) order, that exceeds its device's capacity (-1 if none). A single running sum over all events, the
    device's share taken as the difference from its first event (the order of the sums is
    part of the result: equal inputs give bit-equal peaks)."""
    n = len(dev_s)
    cur = np.empty(n)
    peak = np.full(len(initial), -np.inf)
    acc = 0.0
    before = 0.0
    over = -1
    for i in range(n):
        d = dev_s[i]
        if i > 0 and d != dev_s[i - 1]:
            before = acc
        acc += delta_s[i]
        c = acc - before + initial[d]
        cur[i] = c
        if c > peak[d]:
            peak[d] = c
        if c > capacity[d] and (
            over < 0 or time_s[i] < time_s[over] or (time_s[i] == time_s[over] and phase_s[i] < phase_s[over])
        ):
            over = i
    return cur, peak, over
