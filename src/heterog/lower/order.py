"""The execution order of one iteration: the single rule every consumer follows.

List scheduling over the iteration's task graph (lower/tasks.py): each device runs, among its
ready compute tasks, the one with the smallest key (schedule phase, micro-batch, block order
from the plan's priorities); communication takes no time here. GPipe: a device starts backward
only when all its forwards are done. 1F1B: backward first, and a device admits a new
micro-batch only while fewer than its stage limit are in flight (stage s of p keeps at most
p - s, PipeDream-Flush). The result is the global order in which each device runs its compute
and each link serves its transfers; its projection on a device is that device's program
(lower/lowering.py), which the executor carries out and the simulator times (simulate/engine.py).

Why a fixed order: with fixed orders every start time is a max of sums of durations (a max-plus
system, Baccelli et al. 1992), so the iteration time never grows when a link gets faster or a
task shorter; dynamic list scheduling and first-come links both have Graham-style anomalies.
The order does not depend on link bandwidths, only on compute times and priorities.
"""

from __future__ import annotations

from heapq import heappop, heappush

from heterog.lower.taskgraph import BWD, FWD, OPT, Tasks


def _admission(tasks: Tasks, n_devices: int, schedule: str):
    """The state of the admission rules: forwards left per device (GPipe holds backward until
    they are done) and micro-batches in flight per device with their backwards left (1F1B)."""
    fwd_left = [0] * n_devices
    if schedule == "gpipe":
        for k, d in zip(tasks.kind, tasks.dev):
            if k == FWD:
                fwd_left[d] += 1
    in_flight: list[set[int]] = [set() for _ in range(n_devices)]
    return fwd_left, dict(tasks.bwd_count), in_flight


def reference_order(tasks: Tasks, n_devices: int, schedule: str, limit_in_flight: bool = True) -> list[int] | None:
    """Start order of all tasks under list scheduling with zero-time communication; None if
    the 1F1B admission rule deadlocks on this placement (the caller retries without it)."""
    dur, dev, succ, n = tasks.dur, tasks.dev, tasks.succ, len(tasks.kind)
    kind, mb, limit = tasks.kind, tasks.mb, tasks.stage_limit
    gpipe = schedule == "gpipe"
    one_f1b = not gpipe and limit_in_flight
    fwd_left, bwd_left, in_flight = _admission(tasks, n_devices, schedule)
    prio = tasks.key
    left = tasks.npred[:]
    ready: list[list] = [[] for _ in range(n_devices)]     # heaps of (key, task)
    busy = [False] * n_devices
    events: list[tuple[float, int]] = []
    order: list[int] = []
    for t in tasks.sources:
        left[t] = 1            # counted down once below, like a successor
    touched: list[int] = []
    _release(list(tasks.sources), touched, left, dev, succ, prio, ready, order)
    now = 0.0
    while True:
        for d in touched:      # each idle device starts its best eligible ready task
            q = ready[d]
            if busy[d] or not q:
                continue
            t = q[0][1]
            k = kind[t]
            if gpipe and k == BWD and fwd_left[d] > 0:
                continue
            if one_f1b and k == FWD:
                fl = in_flight[d]
                if mb[t] not in fl and len(fl) >= limit[d]:
                    continue
            heappop(q)
            if one_f1b and k != OPT:
                in_flight[d].add(mb[t])
            busy[d] = True
            order.append(t)
            heappush(events, (now + dur[t], t))
        if not events:
            break
        now, t = heappop(events)
        d = dev[t]
        busy[d] = False
        k = kind[t]
        if gpipe and k == FWD:
            fwd_left[d] -= 1
        elif one_f1b and k == BWD:
            km = (d, mb[t])
            bwd_left[km] -= 1
            if bwd_left[km] == 0:
                in_flight[d].discard(mb[t])
        touched = [d]
        for s0 in reversed(succ[t]):     # direct successors inline: the common case
            left[s0] -= 1
            if left[s0] == 0:
                ds = dev[s0]
                if ds >= 0:
                    heappush(ready[ds], (prio[s0], s0))
                    touched.append(ds)
                else:
                    order.append(s0)
                    _release(succ[s0][:], touched, left, dev, succ, prio, ready, order)
    return order if len(order) == n else None


def _release(stack: list[int], touched: list[int], left: list[int], dev: list[int], succ: list[list[int]],
             prio: list[tuple], ready: list[list], order: list[int]) -> None:
    """Count down the tasks on `stack` (taken from its end, so the last successor first):
    communication that becomes ready completes at once (depth first) and compute joins its
    device's ready queue; devices whose queue grew are added to `touched`."""
    while stack:
        s = stack.pop()
        left[s] -= 1
        if left[s] == 0:
            ds = dev[s]
            if ds < 0:
                order.append(s)
                stack.extend(succ[s])
            else:
                heappush(ready[ds], (prio[s], s))
                touched.append(ds)
