"""The timed simulation of one iteration: the Program's order (lower/order.py) with times.

A compute task starts when its inputs are ready and it is next on its device; a transfer or
collective starts when its inputs are ready and it is next on every link it occupies, and
holds all of them for its whole (uncontended) time. Links are therefore FIFO and exclusive:
two transfers sharing a NIC take twice as long as one. Links that serve exactly the same tasks
(e.g. the ~2300 links of a 1024-device ring that nothing else uses) are merged into one
resource first. An oversubscribed switch core is the exception: a pipe that moves the bytes of
the transfers crossing it one after another at its bandwidth, while their NIC parts overlap.
Fixed orders keep the max-plus property (lower/order.py); the switch core's pipe is one more
max-plus stage.
"""

from __future__ import annotations

from heapq import heappop, heappush

from heterog.lower.taskgraph import Tasks


def _link_classes(by_path: dict[tuple[int, ...], list[int]], task_links: list, comm_order: list[int]):
    """Merge links that serve exactly the same tasks into one resource. With fixed orders such
    links are redundant: a ring all-reduce over 1024 devices crosses ~2300 links that nothing
    else uses, and they act as one. Returns (per-task tuple of class ids, per-class order)."""
    paths = list(by_path)
    member_of: dict[int, list[int]] = {}
    for pi, path in enumerate(paths):
        for l in path:
            lst = member_of.get(l)
            if lst is None:
                member_of[l] = [pi]
            else:
                lst.append(pi)
    class_of_key: dict[tuple[int, ...], int] = {}
    class_of_link: dict[int, int] = {}
    for l, pis in member_of.items():
        class_of_link[l] = class_of_key.setdefault(tuple(pis), len(class_of_key))
    position = {}
    link_order: list[list[int]] = []
    for key in class_of_key:          # insertion order = class id order
        if len(key) == 1:
            link_order.append(by_path[paths[key[0]]])
        else:
            if not position:
                position = {t: i for i, t in enumerate(comm_order)}
            merged = [t for pi in key for t in by_path[paths[pi]]]
            merged.sort(key=position.__getitem__)
            link_order.append(merged)
    classes_of_path = {path: tuple(sorted({class_of_link[l] for l in path})) for path in paths}
    links: list[tuple[int, ...]] = [()] * len(task_links)
    for t in comm_order:
        lk = task_links[t]
        if lk:
            links[t] = classes_of_path[lk]
    return links, link_order


def _split_shared(tasks: Tasks, shared_bw: dict[int, float]):
    """Per task: its exclusive links, the switch-core links it crosses, and the bytes it
    pushes through them."""
    n = len(tasks.kind)
    excl: list[tuple[int, ...]] = tasks.links
    shared_of: list[tuple[int, ...]] = [()] * n
    core_bytes = [0.0] * n
    if not shared_bw:
        return excl, shared_of, core_bytes
    excl = list(excl)
    split: dict[tuple[int, ...], tuple] = {}
    links = tasks.links
    for t in tasks.comm:      # compute tasks occupy no links
        lk = links[t]
        if not lk:
            continue
        hit = split.get(lk)
        if hit is None:
            sh = tuple(l for l in lk if l in shared_bw)
            hit = split[lk] = (tuple(l for l in lk if l not in shared_bw) if sh else lk, sh)
        excl[t] = hit[0]
        if hit[1]:
            shared_of[t] = hit[1]
            core_bytes[t] = tasks.core_bytes.get(t, tasks.comm[t][1])
    return excl, shared_of, core_bytes


def run(tasks: Tasks, order: list[int], n_devices: int,
        capacity_bytes: list[int], record: bool, shared_bw: dict[int, float] | None = None):
    """Timed simulation following `order`. Returns (start, end, peak, overflow, mem_trace)
    with overflow = (device, time) of the first device to exceed its memory, or None.

    shared_bw: switch-core links. The core is a pipe that moves bytes at its bandwidth in the
    fixed order, alongside the NICs: a transfer that crosses it ends no earlier than its own
    time and than the core has pushed its bytes after those of the transfers before it. Two
    transfers on disjoint NICs thus overlap fully under a fast core and share a slow one."""
    dur, dev, succ = tasks.dur, tasks.dev, tasks.succ
    mem_start, mem_end = tasks.mem_start, tasks.mem_end
    n = len(dur)
    excl, shared_of, core_bytes = _split_shared(tasks, shared_bw or {})
    # A task may start once its inputs are ready and it heads its device's queue or every
    # link queue it uses: its predecessor in each queue counts as one more input. `after[t]`
    # lists what t's end releases: its queue successors (device, then links in class order),
    # then its graph successors.
    left = tasks.npred[:]
    after = list(succ)
    last = [-1] * n_devices       # the device's previous task in the order
    by_path: dict[tuple[int, ...], list[int]] = {}   # link set → its tasks, in order
    s_order: dict[int, list[int]] = {l: [] for l in shared_bw or ()}
    comm_order: list[int] = []
    for t in order:
        d = dev[t]
        if d >= 0:
            p = last[d]
            last[d] = t
            if p >= 0:
                sp = succ[p]
                if t not in sp:   # else already an input of t, released at the same place
                    after[p] = [t] + sp
                    left[t] += 1
        else:
            comm_order.append(t)
            lk = excl[t]
            if lk:
                lst = by_path.get(lk)
                if lst is None:
                    by_path[lk] = [t]
                else:
                    lst.append(t)
            for l in shared_of[t]:
                s_order[l].append(t)
    s_next = {l: 0 for l in s_order}
    s_free = {l: 0.0 for l in s_order}      # when the core has pushed the bytes before
    s_cap = dict(shared_bw or {})
    links, link_order = _link_classes(by_path, excl, comm_order)
    if link_order:
        nxt: list[dict[int, int]] = []
        for lo in link_order:
            nxt.append(dict(zip(lo, lo[1:])))
            for b in lo[1:]:
                left[b] += 1
        for t in comm_order:
            heads = [nxt[l][t] for l in links[t] if t in nxt[l]]
            if heads:
                after[t] = heads + succ[t]
    started = bytearray(n)      # only tasks crossing a switch core can be queued twice
    n_started = 0
    start = [0.0] * n
    end = [0.0] * n
    cur = list(tasks.initial_bytes)
    peak = list(cur)
    overflow = None
    for d in range(n_devices):
        if cur[d] > capacity_bytes[d] and overflow is None:
            overflow = (d, 0.0)
    trace: list[list[tuple[float, float]]] | None = None
    if record:
        trace = [[(0.0, cur[d])] if cur[d] else [] for d in range(n_devices)]
    events: list[tuple[float, int]] = []
    ready_now: list[int] = [t for t in tasks.sources if left[t] == 0]   # no queue predecessor
    push, pop = heappush, heappop
    now = 0.0
    while True:
        # start every task whose inputs and queue predecessors are done
        while ready_now:
            t = ready_now.pop()
            finish = now + dur[t]
            sh = shared_of[t]
            if sh:
                if started[t] or any(s_order[l][s_next[l]] != t for l in sh):
                    continue
                started[t] = 1
                for l in sh:
                    core_end = max(now, s_free[l]) + core_bytes[t] / s_cap[l]
                    s_free[l] = core_end
                    if core_end > finish:
                        finish = core_end
                    s_next[l] += 1
                    so = s_order[l]
                    if s_next[l] < len(so) and left[so[s_next[l]]] == 0:
                        ready_now.append(so[s_next[l]])
            n_started += 1
            start[t] = now
            push(events, (finish, t))
            ms = mem_start[t]
            if ms is None:
                continue
            for md, delta in ms:
                c = cur[md] + delta
                cur[md] = c
                if c > peak[md]:
                    peak[md] = c
                    if overflow is None and c > capacity_bytes[md]:
                        overflow = (md, now)
                if record:
                    trace[md].append((now, c))
        if not events:
            break
        now, t = pop(events)
        end[t] = now
        me = mem_end[t]
        if me is not None:
            if record:
                for md, delta in me:
                    c = cur[md] + delta
                    cur[md] = c
                    trace[md].append((now, c))
            else:
                for md, delta in me:
                    cur[md] += delta
        for s in after[t]:
            left[s] -= 1
            if left[s] == 0:
                ready_now.append(s)
    assert n_started == n, "fixed orders taken from a feasible schedule cannot deadlock"
    return start, end, peak, overflow, trace
