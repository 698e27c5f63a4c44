"""The execution order of one iteration: the single rule every consumer follows.

List scheduling over the iteration's task graph (lower/tasks.py): each device runs, among its
ready compute tasks, the one with the smallest key (schedule phase, micro-batch, block order
from the plan's priorities); communication takes no time here. GPipe: a device starts backward
only when all its forwards are done (but the later pieces of a replica that accumulates, which
each wait for the backward of the piece before). 1F1B: backward first, and a device admits a new
micro-batch only while fewer than its stage limit are in flight (stage s of p keeps at most
p - s, PipeDream-Flush). The result is the global order in which each device runs its compute
and each link serves its transfers; its projection on a device is that device's program
(lower/lowering.py), which the executor carries out and the simulator times (simulate/engine.py).

Why a fixed order: with fixed orders every start time is a max of sums of durations (a max-plus
system, Baccelli et al. 1992), so the iteration time never grows when a link gets faster or a
task shorter; dynamic list scheduling and first-come links both have Graham-style anomalies.
The order does not depend on link bandwidths, only on compute times and priorities.

The list scheduler is compiled (numba): the search calls it for every neighbour it scores,
on task graphs of up to ~60 000 tasks, where a Python loop cost µs per task. Where numba
cannot be imported the same source runs as plain Python, with the same order (heterog/_jit.py).
"""

from __future__ import annotations

import numpy as np

from heterog._jit import njit
from heterog.ir.kinds import PipelineSchedule
from heterog.lower.taskgraph import BWD, FWD, OPT, Tasks


def reference_order(tasks: Tasks, n_devices: int, schedule: str, limit_in_flight: bool = True) -> np.ndarray | None:
    """Start order of all tasks (task ids) under list scheduling with zero-time
    communication; None if the 1F1B admission rule deadlocks on this placement (the caller
    retries without it)."""
    n = len(tasks.kind)
    succ_ptr, succ_idx = tasks.succ_csr()
    n_mb = max(tasks.mb, default=0) + 1
    bwd_left = np.zeros((n_devices, n_mb), dtype=np.int64)
    for (d, m), c in tasks.bwd_count.items():
        bwd_left[d, m] = c
    gpipe = schedule == PipelineSchedule.GPIPE
    order, count = _list_schedule(
        tasks.array("dur"),
        tasks.array("dev"),
        tasks.array("kind"),
        tasks.array("mb"),
        tasks.array("key"),
        tasks.npred,
        succ_ptr,
        succ_idx,
        tasks.sources,
        np.asarray(tasks.stage_limit, dtype=np.int64),
        bwd_left,
        n_devices,
        gpipe,
        not gpipe and limit_in_flight,
    )
    return order if count == n else None


@njit(cache=True, nogil=True)
def _list_schedule(
    dur, dev, kind, mb, key, npred, succ_ptr, succ_idx, sources, limit, bwd_left, n_devices, gpipe, one_f1b
):
    """The list scheduler (see the module docstring). Each device keeps a binary heap of its
    ready compute tasks ordered by (key, task); the busy devices' end events form a heap
    ordered by (time, task). GPipe holds a device's backwards until its forwards are done;
    1F1B admits a new micro-batch on a device only while fewer than its stage limit are in
    flight there (a micro-batch retires when its last backward on the device ends).
    Communication completes at once, depth first, when its inputs are done.
    Returns (order, number of tasks ordered)."""
    n = len(dur)
    left = npred.copy()
    heap, base, hsize = _device_heaps(dev, n, n_devices)
    ev_time = np.empty(n_devices + 1, dtype=np.float64)
    ev_task = np.empty(n_devices + 1, dtype=np.int64)
    n_ev = 0
    busy = np.zeros(n_devices, dtype=np.bool_)
    gated = _gating_forwards(kind, succ_ptr, succ_idx, n)
    fwd_left = _forward_counts(gated, dev, n, n_devices) if gpipe else np.zeros(n_devices, dtype=np.int64)
    in_flight = np.zeros((n_devices, bwd_left.shape[1]), dtype=np.bool_)
    n_in_flight = np.zeros(n_devices, dtype=np.int64)
    order = np.empty(n, dtype=np.int64)
    touched = np.empty(n + 1, dtype=np.int64)
    stack = np.empty(len(succ_idx) + len(sources) + 1, dtype=np.int64)
    # the sources are released like successors of a virtual task, the last one first
    for i in range(len(sources)):
        left[sources[i]] = 1
        stack[i] = sources[i]
    n_order, n_touched = _release(
        stack, len(sources), touched, 0, left, dev, succ_ptr, succ_idx, key, n, heap, base, hsize, order, 0
    )
    now = 0.0
    while True:
        for i in range(n_touched):  # each idle device starts its best eligible ready task
            d = touched[i]
            if busy[d] or hsize[d] == 0:
                continue
            t = heap[base[d]] % n
            k = kind[t]
            if gpipe and k == BWD and fwd_left[d] > 0:
                continue
            if one_f1b and k == FWD and not in_flight[d, mb[t]] and n_in_flight[d] >= limit[d]:
                continue
            _heap_pop(heap, base[d], hsize, d)
            if one_f1b and kind[t] != OPT and not in_flight[d, mb[t]]:
                in_flight[d, mb[t]] = True
                n_in_flight[d] += 1
            busy[d] = True
            order[n_order] = t
            n_order += 1
            n_ev = _event_push(ev_time, ev_task, n_ev, now + dur[t], t)
        if n_ev == 0:
            break
        now = ev_time[0]
        t = ev_task[0]
        n_ev = _event_pop(ev_time, ev_task, n_ev)
        d = dev[t]
        busy[d] = False
        k = kind[t]
        if gpipe and gated[t]:
            fwd_left[d] -= 1
        elif one_f1b and k == BWD:
            bwd_left[d, mb[t]] -= 1
            if bwd_left[d, mb[t]] == 0 and in_flight[d, mb[t]]:
                in_flight[d, mb[t]] = False
                n_in_flight[d] -= 1
        touched[0] = d
        n_touched = 1
        for j in range(succ_ptr[t + 1] - 1, succ_ptr[t] - 1, -1):  # last successor first
            stack[0] = succ_idx[j]
            n_order, n_touched = _release(
                stack, 1, touched, n_touched, left, dev, succ_ptr, succ_idx, key, n, heap, base, hsize, order, n_order
            )
    return order, n_order


@njit(cache=True, nogil=True)
def _device_heaps(dev, n, n_devices):
    """Per-device heaps of ready tasks, one slice of `heap` each (capacity: the device's
    tasks); entries are key * n + task, so one int compare orders them."""
    cap = np.zeros(n_devices + 1, dtype=np.int64)
    for t in range(n):
        if dev[t] >= 0:
            cap[dev[t] + 1] += 1
    return np.empty(max(n, 1), dtype=np.int64), np.cumsum(cap), np.zeros(n_devices, dtype=np.int64)


@njit(cache=True, nogil=True)
def _gating_forwards(kind, succ_ptr, succ_idx, n):
    """The forwards GPipe's rule waits for: all but those that follow a backward — a later
    piece of a replica that accumulates (lower/tasks.py `_one_piece_at_a_time`), which must
    wait for its piece before it."""
    gated = np.zeros(n, dtype=np.bool_)
    for t in range(n):
        gated[t] = kind[t] == FWD
    for t in range(n):
        if kind[t] == BWD:
            for j in range(succ_ptr[t], succ_ptr[t + 1]):
                gated[succ_idx[j]] = False
    return gated


@njit(cache=True, nogil=True)
def _forward_counts(gated, dev, n, n_devices):
    """Gating forward tasks per device (GPipe holds a device's backwards until they are done)."""
    fwd_left = np.zeros(n_devices, dtype=np.int64)
    for t in range(n):
        if gated[t]:
            fwd_left[dev[t]] += 1
    return fwd_left


@njit(cache=True, nogil=True, inline="always")
def _release(
    stack, n_stack, touched, n_touched, left, dev, succ_ptr, succ_idx, key, n, heap, base, hsize, order, n_order
):
    """Count down the tasks on `stack` (taken from its end): communication that becomes
    ready completes at once (its successors pushed, depth first), compute joins its device's
    ready heap and the device is added to `touched`."""
    while n_stack > 0:
        n_stack -= 1
        s = stack[n_stack]
        left[s] -= 1
        if left[s] == 0:
            ds = dev[s]
            if ds < 0:
                order[n_order] = s
                n_order += 1
                for j in range(succ_ptr[s], succ_ptr[s + 1]):
                    stack[n_stack] = succ_idx[j]
                    n_stack += 1
            else:
                _heap_push(heap, base[ds], hsize, ds, key[s] * n + s)
                touched[n_touched] = ds
                n_touched += 1
    return n_order, n_touched


@njit(cache=True, nogil=True, inline="always")
def _heap_push(heap, b, hsize, d, v):
    i = hsize[d]
    hsize[d] = i + 1
    while i > 0:
        p = (i - 1) >> 1
        if heap[b + p] <= v:
            break
        heap[b + i] = heap[b + p]
        i = p
    heap[b + i] = v


@njit(cache=True, nogil=True, inline="always")
def _heap_pop(heap, b, hsize, d):
    m = hsize[d] - 1
    hsize[d] = m
    v = heap[b + m]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= m:
            break
        if c + 1 < m and heap[b + c + 1] < heap[b + c]:
            c += 1
        if heap[b + c] >= v:
            break
        heap[b + i] = heap[b + c]
        i = c
    if m > 0:
        heap[b + i] = v


@njit(cache=True, nogil=True, inline="always")
def _event_less(ta, ka, tb, kb):
    return ta < tb or (ta == tb and ka < kb)


@njit(cache=True, nogil=True, inline="always")
def _event_push(ev_time, ev_task, n_ev, time, task):
    i = n_ev
    while i > 0:
        p = (i - 1) >> 1
        if not _event_less(time, task, ev_time[p], ev_task[p]):
            break
        ev_time[i] = ev_time[p]
        ev_task[i] = ev_task[p]
        i = p
    ev_time[i] = time
    ev_task[i] = task
    return n_ev + 1


@njit(cache=True, nogil=True, inline="always")
def _event_pop(ev_time, ev_task, n_ev):
    m = n_ev - 1
    time, task = ev_time[m], ev_task[m]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= m:
            break
        if c + 1 < m and _event_less(ev_time[c + 1], ev_task[c + 1], ev_time[c], ev_task[c]):
            c += 1
        if not _event_less(ev_time[c], ev_task[c], time, task):
            break
        ev_time[i] = ev_time[c]
        ev_task[i] = ev_task[c]
        i = c
    if m > 0:
        ev_time[i] = time
        ev_task[i] = task
    return m
