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

from heterog.lower.taskgraph import Tasks


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
    return start, end, peak, overflow, trace


def _times(tasks: Tasks, order: list[int], n_devices: int, shared_bw: dict[int, float]):
    """Start and end of every task: one pass over the fixed order (see the module docstring)."""
    dur, dev, succ = tasks.dur, tasks.dev, tasks.succ
    n = len(dur)
    classes, n_classes, shared_of, core_bytes = _resources(tasks, shared_bw)
    ready = [0.0] * n                 # when the inputs of a task are all done
    start = [0.0] * n
    end = [0.0] * n
    dev_free = [0.0] * n_devices      # end of the device's previous task
    link_free = [0.0] * n_classes     # end of the link class's previous task
    core_started = {l: 0.0 for l in shared_bw}   # start of the core's previous transfer
    core_free = {l: 0.0 for l in shared_bw}      # when the core has pushed the bytes before
    for t in order:
        s = ready[t]
        d = dev[t]
        if d >= 0:
            f = dev_free[d]
            if f > s:
                s = f
            e = s + dur[t]
            dev_free[d] = e
        else:
            cl = classes[t]
            for c in cl:
                f = link_free[c]
                if f > s:
                    s = f
            sh = shared_of[t]
            if sh:
                s, e = _through_core(s, dur[t], sh, core_bytes[t], shared_bw, core_started, core_free)
            else:
                e = s + dur[t]
            for c in cl:
                link_free[c] = e
        start[t] = s
        end[t] = e
        for u in succ[t]:
            if ready[u] < e:
                ready[u] = e
    return start, end


def _through_core(s: float, dur: float, cores: tuple[int, ...], nbytes: float, bandwidth: dict[int, float],
                  started: dict[int, float], free: dict[int, float]) -> tuple[float, float]:
    """A transfer crossing switch cores: it starts no earlier than the core's previous
    transfer started, and ends no earlier than the core has pushed its bytes."""
    for l in cores:
        if started[l] > s:
            s = started[l]
    e = s + dur
    for l in cores:
        started[l] = s
        core_end = max(s, free[l]) + nbytes / bandwidth[l]
        free[l] = core_end
        if core_end > e:
            e = core_end
    return s, e


def _resources(tasks: Tasks, shared_bw: dict[int, float]):
    """Per task: the link classes it holds (links that serve exactly the same tasks merged:
    with fixed orders they act as one, e.g. the ~2300 links of a 1024-device ring), the number
    of classes, the switch-core links it crosses and the bytes it pushes through them."""
    links = tasks.links
    n = len(links)
    shared_of: list[tuple[int, ...]] = [()] * n
    core_bytes = [0.0] * n
    paths: dict[tuple[int, ...], tuple[int, ...]] = {}    # link set → its exclusive links
    cores: dict[tuple[int, ...], tuple[int, ...]] = {}    # link set → its switch-core links
    comm_links = [(t, links[t]) for t in tasks.comm if links[t]]
    for _, lk in comm_links:
        if lk not in paths:
            if shared_bw:
                cores[lk] = tuple(l for l in lk if l in shared_bw)
                paths[lk] = tuple(l for l in lk if l not in shared_bw) if cores[lk] else lk
            else:
                paths[lk] = lk
    if shared_bw:
        for t, lk in comm_links:
            sh = cores[lk]
            if sh:
                shared_of[t] = sh
                core_bytes[t] = tasks.core_bytes.get(t, tasks.comm[t][1])
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
    classes: list[tuple[int, ...]] = [()] * n
    for t, lk in comm_links:
        classes[t] = classes_of_path[lk]
    return classes, len(class_of_key), shared_of, core_bytes


def _memory(tasks: Tasks, start: list[float], end: list[float], n_devices: int,
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


def _effects(effects: list, when: list[float], phase: int):
    """The memory effects of one kind (at starts or at ends) as arrays: time, device, bytes, phase."""
    tids = [t for t, e in enumerate(effects) if e is not None]
    if not tids:
        empty = np.zeros(0)
        return empty, empty.astype(np.intp), empty, empty.astype(np.intp)
    lists = [effects[t] for t in tids]
    counts = np.fromiter(map(len, lists), dtype=np.intp, count=len(lists))
    devs, deltas = zip(*chain.from_iterable(lists))
    times = np.repeat(np.array(when)[tids], counts)
    return (times, np.array(devs, dtype=np.intp), np.array(deltas, dtype=float),
            np.full(len(times), phase, dtype=np.intp))
