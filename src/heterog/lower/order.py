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


def reference_order(tasks: Tasks, n_devices: int, schedule: str, limit_in_flight: bool = True) -> list[int] | None:
    """Start order of all tasks under list scheduling with zero-time communication; None if
    the 1F1B admission rule deadlocks on this placement (the caller retries without it)."""
    kind, dur, dev, succ, key, mb = tasks.kind, tasks.dur, tasks.dev, tasks.succ, tasks.key, tasks.mb
    left = tasks.npred[:]
    n = len(kind)
    ready: list[list] = [[] for _ in range(n_devices)]
    busy = [False] * n_devices
    gpipe = schedule == "gpipe"
    one_f1b = not gpipe and limit_in_flight
    fwd_left = [0] * n_devices
    if gpipe:
        for t in range(n):
            if kind[t] == FWD:
                fwd_left[dev[t]] += 1
    limit = tasks.stage_limit
    bwd_left = dict(tasks.bwd_count)
    in_flight: list[set[int]] = [set() for _ in range(n_devices)]
    events: list[tuple[float, int]] = []
    order: list[int] = []
    push = heappush
    now = 0.0
    finished = -1             # the task whose end is being processed (-1: the start)

    def release(stack: list[int], touched: list[int]) -> None:
        """Count down the tasks on `stack`; communication that becomes ready completes at
        once (depth first) and compute joins its device's ready queue."""
        while stack:
            s = stack.pop()
            left[s] -= 1
            if left[s] == 0:
                ds = dev[s]
                if ds < 0:
                    order.append(s)
                    stack.extend(succ[s])
                else:
                    push(ready[ds], (key[s], s))
                    touched.append(ds)

    while True:
        # release successors; communication takes no time here, so it completes on the spot
        if finished < 0:
            stack = list(tasks.sources)
            for t in stack:
                left[t] = 1   # counted down once below, like a successor
            touched = []
        else:     # the walk below without copying succ: depth first, last successor first
            stack = []
            touched = [dev[finished]]     # only compute tasks take time
            for s0 in reversed(succ[finished]):
                left[s0] -= 1
                if left[s0] == 0:
                    ds = dev[s0]
                    if ds >= 0:
                        push(ready[ds], (key[s0], s0))
                        touched.append(ds)
                    else:
                        order.append(s0)
                        stack.extend(succ[s0])
                        release(stack, touched)
        release(stack, touched)
        for d in touched:     # each idle device starts its best eligible ready task
            if busy[d]:
                continue
            q = ready[d]
            if not q:
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
        finished = t
    if len(order) < n:
        return None
    return order
