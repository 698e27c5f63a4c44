"""What the schedule and the simulator compute once and reuse across calls: the group DAG of a
grouping, per-group costs on each device class, link indices and paths of a cluster.

The search calls `simulate` thousands of times with small changes to one plan (a group moved,
a share nudged). Everything here depends only on (graph, grouping), (graph, costs) or the
cluster, so it is cached in a SimCache the caller owns, and the per-call work is proportional to the
plan's tasks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.opgraph import OpGraph
from heterog.lower.caches import CostTable


def device_class_key(cluster: Cluster, device: str) -> tuple:
    """Devices with equal keys are one *class*: the cost model gives them the same node times
    and memory, so costs are computed once per class (the simulator's and the search's rule)."""
    d = cluster.device(device)
    return (d.gpu_type, d.slowdown, cluster.memory_bytes(device), cluster.host_speed(device))


class NumberedSets:
    """Distinct tuples of ints — the link sets communication tasks hold, their member
    devices — numbered, each also split for the timed pass (simulate/engine.py) into the links
    it holds exclusively and the switch cores it crosses (indices into shared_bw), which it
    shares as a pipe. Kept flat, so per-task rows and sums are gathered with numpy, not
    task by task."""

    ALL, EXCLUSIVE, CORES = 0, 1, 2  # the parts of a set

    def __init__(self, core_index: dict[int, int]):
        self._core_index = core_index
        self._id: dict[tuple[int, ...], int] = {}
        self._by_object: dict[int, tuple[tuple[int, ...], int]] = {}  # id(tuple) → (tuple, number)
        self._parts: tuple[list, list, list] = ([], [], [])
        self._flat: list | None = None
        self.generation = 0  # numbers given before a restart are stale

    def ids(self, sets: list[tuple[int, ...]]) -> np.ndarray:
        """The number of each set (valid until the next call). Found first by the tuple's
        identity (paths and rings are cached tuples, met again every call), then by content."""
        if len(self._id) > 100_000 or len(self._by_object) > 200_000:
            self._id.clear()
            self._by_object.clear()
            self._parts = ([], [], [])
            self.generation += 1
        get, by_object, out = self._id.get, self._by_object, []
        for links in sets:
            hit = by_object.get(id(links))
            if hit is not None and hit[0] is links:
                out.append(hit[1])
                continue
            i = get(links)
            if i is None:
                i = self._add(links)
            by_object[id(links)] = (links, i)  # holds the tuple: its id stays its own
            out.append(i)
        return np.array(out, dtype=np.int64)

    def _add(self, links: tuple[int, ...]) -> int:
        core = self._core_index
        i = self._id[links] = len(self._id)
        self._parts[self.ALL].append(links)
        self._parts[self.EXCLUSIVE].append([link for link in links if link not in core])
        self._parts[self.CORES].append([core[link] for link in links if link in core])
        self._flat = None
        return i

    def gather(self, sets: np.ndarray, part: int) -> tuple[np.ndarray, np.ndarray]:
        """The given part of each set in `sets`, one after the other: (values, per-set lengths)."""
        if self._flat is None:
            self._flat = [_flatten(rows) for rows in self._parts]
        flat, start, length = self._flat[part]
        per_set = length[sets]
        return flat[id_runs(start[sets], per_set)], per_set

    def rows(self, n: int, tasks: np.ndarray, sets: np.ndarray, part: int) -> tuple[np.ndarray, np.ndarray]:
        """Compressed rows (pointer, index) over n tasks: row t of `tasks` (increasing) is the
        part of its set; other rows are empty."""
        values, per_set = self.gather(sets, part)
        lengths = np.zeros(n, dtype=np.int64)
        lengths[tasks] = per_set
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=ptr[1:])
        return ptr, values


def id_runs(firsts, counts) -> np.ndarray:
    """The ids firsts[i], firsts[i] + 1, …, firsts[i] + counts[i] − 1 of every run i, one run
    after the other (numpy, no Python loop)."""
    count = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(count)
    total = int(ends[-1]) if len(ends) else 0
    return np.repeat(np.asarray(firsts, dtype=np.int64) - (ends - count), count) + np.arange(total, dtype=np.int64)


def _flatten(rows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows as (all values, each row's start, each row's length)."""
    length = np.array([len(r) for r in rows], dtype=np.int64)
    start = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(length[:-1], out=start[1:])
    return np.array([x for r in rows for x in r], dtype=np.int64), start, length


class ClusterInfo:
    """Integer ids for devices and links, cached paths, and device classes.

    Devices of one GPU type with equal slowdown, memory and host speed are one *class*: the cost model
    gives them the same node times (the analytic model and type-level profiles both do), so
    node times are computed once per class, which keeps a 1024-device plan cheap.
    """

    def __init__(self, cluster: Cluster, own_class: frozenset[str] = frozenset()):
        """own_class: devices each in a class of its own (a cost model whose times depend on
        more than the device's type: a tensor-parallel rank's on its group's links)."""
        self.cluster = cluster
        self.devices = [d.name for d in cluster.devices]
        self.dev_id = {n: i for i, n in enumerate(self.devices)}
        self.links = list(cluster.links)
        self.link_id = {n: i for i, n in enumerate(self.links)}
        # switch cores are pipes shared by the transfers crossing them (engine.run)
        self.shared_bw = {
            self.link_id[link.name]: link.bandwidth_bytes_per_s
            for link in cluster.links.values()
            if link.kind == "switch"
        }
        self._core_index = {link: i for i, link in enumerate(self.shared_bw)}
        node_order = {n.name: i for i, n in enumerate(cluster.nodes)}
        self.node_rank = [node_order[d.node] for d in cluster.devices]
        rep: dict[tuple, str] = {}
        self.dev_class: list[str] = []
        for d in cluster.devices:
            key = (d.name,) if d.name in own_class else device_class_key(cluster, d.name)
            self.dev_class.append(rep.setdefault(key, d.name))
        self.class_names = list(dict.fromkeys(self.dev_class))  # one name per class
        index = {c: i for i, c in enumerate(self.class_names)}
        self.class_index = np.array([index[c] for c in self.dev_class], dtype=np.int64)
        self.capacity_bytes = [cluster.memory_bytes(n) for n in self.devices]
        self._paths: dict[tuple[int, int], tuple[int, ...]] = {}
        self._names: dict[tuple[int, ...], tuple[str, ...]] = {}
        self._ids: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}
        # a ring by its members; a star by (members, server)
        self._rings: dict[tuple, tuple[tuple[int, ...], dict[int, float]]] = {}
        self.known_device_sets: set[int] = set()  # SimCache device-set numbers checked against it
        self.link_sets = NumberedSets(self._core_index)
        self.member_sets = NumberedSets({})

    def ids(self, names: tuple[str, ...]) -> tuple[int, ...]:
        hit = self._ids.get(names)
        if hit is None:
            if len(self._ids) > 10_000:
                self._ids.clear()
            hit = self._ids[names] = tuple(self.dev_id[n] for n in names)
        return hit

    def device_array(self, ids: tuple[int, ...]) -> np.ndarray:
        """Device ids as an array, made once per tuple."""
        hit = self._arrays.get(ids)
        if hit is None:
            if len(self._arrays) > 10_000:
                self._arrays.clear()
            hit = self._arrays[ids] = np.array(ids, dtype=np.int64)
        return hit

    def names(self, ids: tuple[int, ...]) -> tuple[str, ...]:
        hit = self._names.get(ids)
        if hit is None:
            hit = self._names[ids] = tuple(self.devices[d] for d in ids)
        return hit

    def path(self, src: int, dst: int) -> tuple[int, ...]:
        key = (src, dst)
        p = self._paths.get(key)
        if p is None:
            p = tuple(self.link_id[link] for link in self.cluster.path(self.devices[src], self.devices[dst]))
            self._paths[key] = p
        return p

    def ring(self, members: tuple[int, ...]) -> tuple[tuple[int, ...], dict[int, float]]:
        """Links a collective over `members` occupies, and the share of the buffer each carries.

        Members are ordered by node so the ring crosses each NIC once per direction (what NCCL's
        topology-aware rings do). A ring all-reduce sends 2(n−1)/n of the buffer over every hop
        (Patarasuk & Yuan 2009); tree and hierarchical all-reduce cross the same NICs and are
        charged the same link set. Returns (link ids, {link id: bytes per buffer byte}).
        """
        hit = self._rings.get(members)
        if hit is None:
            order = self.ring_order(members)
            n = len(order)
            per_hop = 2.0 * (n - 1) / n if n > 1 else 0.0
            load: dict[int, float] = {}
            for i in range(n):
                for link in self.path(order[i], order[(i + 1) % n]):
                    load[link] = load.get(link, 0.0) + per_hop
            hit = (tuple(sorted(load)), load)
            self._rings[members] = hit
        return hit

    def shard_ring(
        self, members: tuple[int, ...], fractions: tuple[float, ...], op: str
    ) -> tuple[tuple[int, ...], dict[int, float]]:
        """ring() for a reduce-scatter or all-gather with uneven pieces: `members` in ring order,
        fractions[i] the piece members[i] owns. Over the n − 1 steps each member sends every
        piece but one (ir/plan.py shard_piece): a reduce-scatter all but its own, an
        all-gather all but its successor's."""
        key = ("shard", members, fractions, op)
        hit = self._rings.get(key)
        if hit is None:
            n = len(members)
            load: dict[int, float] = {}
            for i in range(n if n > 1 else 0):
                kept = fractions[i] if op == "reduce_scatter" else fractions[(i + 1) % n]
                for link in self.path(members[i], members[(i + 1) % n]):
                    load[link] = load.get(link, 0.0) + 1.0 - kept
            hit = self._rings[key] = (tuple(sorted(load)), load)
        return hit

    def ring_order(self, members) -> list[int]:
        """The order of a collective's members: by node, so a ring crosses each NIC once per
        direction (NCCL's topology-aware rings); the executor's collectives follow it."""
        return sorted(members, key=lambda d: (self.node_rank[d], d))

    def star(self, members: tuple[int, ...], server: int) -> tuple[tuple[int, ...], dict[int, float]]:
        """Parameter server: each member sends its gradient to the server and gets parameters back."""
        hit = self._rings.get((members, server))
        if hit is None:
            load: dict[int, float] = {}
            for d in members:
                for link in self.path(d, server) + self.path(server, d):
                    load[link] = load.get(link, 0.0) + 1.0
            hit = self._rings[(members, server)] = (tuple(sorted(load)), load)
        return hit


class Grouping:
    """The plan's partition of the graph as a DAG of groups (depends on graph + node sets only)."""

    def __init__(self, graph: OpGraph, group_names: Sequence[str], group_nodes: Sequence[tuple[str, ...]]):
        owner: dict[str, int] = {}
        index = graph.index
        for gi, nodes in enumerate(group_nodes):
            for n in nodes:
                if n not in index:
                    raise PlanError(
                        f"group {group_names[gi]!r} field 'nodes': node {n!r} is not in the graph of {graph.model}."
                    )
                if n in owner:
                    raise PlanError(
                        f"group {group_names[gi]!r} field 'nodes': node {n!r} is also in "
                        f"group {group_names[owner[n]]!r}; a node belongs to one group."
                    )
                owner[n] = gi
        if len(owner) != len(graph.nodes):
            missing = [n.name for n in graph.nodes if n.name not in owner]
            raise PlanError(
                f"{len(missing)} graph node(s) belong to no group (e.g. {missing[:3]}); "
                f"add them to a group's 'nodes' so every node is placed."
            )
        self.owner = owner
        self.nodes = tuple(group_nodes)
        g = len(group_nodes)
        self.succ: list[set[int]] = [set() for _ in range(g)]
        self.pred: list[set[int]] = [set() for _ in range(g)]
        self.cross: dict[tuple[int, int], list[tuple[str, str]]] = {}
        for e in graph.edges:
            a, b = owner[e.src], owner[e.dst]
            if a != b:
                self.succ[a].add(b)
                self.pred[b].add(a)
                self.cross.setdefault((a, b), []).append((e.src, e.dst))
        # graph nodes are in topological order; a group's position is that of its first node
        self.first = [min(index[n] for n in nodes) for nodes in group_nodes]
        self._orders: dict[tuple[float, ...], list[int]] = {}  # per priority vector
        self._check_acyclic(group_names)

    def _check_acyclic(self, names: Sequence[str]) -> None:
        order = self.order([0.0] * len(self.nodes))
        if len(order) < len(self.nodes):
            stuck = set(range(len(self.nodes))) - set(order)
            a = min(stuck)
            b = next(s for s in self.succ[a] if s in stuck)
            raise PlanError(
                f"groups {names[a]!r} and {names[b]!r} depend on each other through "
                f"their 'nodes' (a cycle among groups): neither could start first. "
                f"Make each group a contiguous piece of the graph."
            )

    def order(self, priority: Sequence[float]) -> list[int]:
        """A topological order of the groups that runs the highest priority first among
        those whose inputs are ready (Kahn's algorithm with a max-heap; ties: graph order);
        remembered per priority vector (the search's plans mostly share one)."""
        key = tuple(priority)
        hit = self._orders.get(key)
        if hit is None:
            if len(self._orders) > 1000:
                self._orders.clear()
            hit = self._orders[key] = self._topological(priority)
        return list(hit)

    def _topological(self, priority: Sequence[float]) -> list[int]:
        indeg = [len(p) for p in self.pred]
        heap = [(-priority[g], self.first[g], g) for g in range(len(indeg)) if indeg[g] == 0]
        heapq.heapify(heap)
        out: list[int] = []
        while heap:
            g = heapq.heappop(heap)[2]
            out.append(g)
            for s in self.succ[g]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (-priority[s], self.first[s], s))
        return out


class SimCache:
    """Everything the schedule and the simulator reuse across calls, in one object owned by
    the caller (the search keeps one per problem; a one-off call makes a fresh one).

    The search calls the simulator thousands of times with small changes to one plan, so
    per-cluster link tables, per-grouping DAGs, per-cost-model tables, placement ids,
    fingerprints and validated plans are kept here, keyed by object identity with a strong
    reference to each key object (an id cannot be reused while cached). One eviction rule:
    each kind keeps at most `limit` entries, oldest first out.
    """

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._entries: dict[str, dict] = {}
        self.placement_ids: dict[tuple, int] = {}  # (device names, shares) or names → small int
        self._next_placement = 0  # ids are never reused: caches keyed by them stay valid

    def _get(self, kind: str, key, owners: tuple, make):
        """The entry for `key`, made if missing or if its key objects (`owners`, compared by
        identity) are not the ones it was made for."""
        cache = self._entries.setdefault(kind, {})
        hit = cache.get(key)
        if hit is None or len(hit[0]) != len(owners) or any(a is not b for a, b in zip(hit[0], owners)):
            if len(cache) >= self.limit:
                cache.pop(next(iter(cache)))
            hit = cache[key] = (owners, make())
        return hit[1]

    def cluster_info(self, cluster: Cluster, own_class: frozenset[str] = frozenset()) -> ClusterInfo:
        return self._get("cluster", (id(cluster), own_class), (cluster,), lambda: ClusterInfo(cluster, own_class))

    def grouping(self, graph: OpGraph, names: Sequence[str], nodes: Sequence[tuple[str, ...]]) -> Grouping:
        """The grouping of these node sets; found first by the identity of the node tuples
        (a neighbour in the search shares them with its plan: hashing ~1000 names per call
        cost more), then by their content."""
        return self._get(
            "grouping by identity",
            (id(graph), *map(id, nodes)),
            (graph, *nodes),
            lambda: self._get("grouping", (id(graph), tuple(nodes)), (graph,), lambda: Grouping(graph, names, nodes)),
        )

    def cost_table(self, graph: OpGraph, costs) -> CostTable:
        return self._get("table", (id(graph), id(costs)), (graph, costs), lambda: CostTable(graph, costs))

    def fingerprint(self, obj) -> str:
        return self._get("fingerprint", id(obj), (obj,), obj.fingerprint)

    def validate(self, plan) -> None:
        """plan.validate(), skipping plans and groups validated before (both are frozen; a
        neighbour in the search shares all groups but one with its plan)."""
        plans = self._entries.setdefault("validated", {})
        if plans.get(id(plan), (None,))[0] is plan:
            return
        groups = self._entries.setdefault("validated groups", {})
        plan.validate(checked=lambda g: groups.get(id(g), (None,))[0] is g)
        if len(plans) >= 4 * self.limit:
            plans.clear()
        if len(groups) >= 1000 * self.limit:
            groups.clear()
        plans[id(plan)] = (plan, True)
        for g in plan.groups:
            groups[id(g)] = (g, True)

    def _number(self, key: tuple) -> int:
        n = self.placement_ids.get(key)
        if n is None:
            n = self.placement_ids[key] = self._next_placement
            self._next_placement += 1
        return n

    def placement(self, replicas: tuple) -> tuple[int, tuple[str, ...], tuple[float, ...], int]:
        """(id, device names, shares, id of the device set) of a placement: small integers
        per distinct placement and device set, never reused (comparing and hashing 64-replica
        tuples made block fusion and the caches keyed by them slow). Cached by the tuple's
        identity: the search re-uses unchanged groups between plans."""
        cache = self._entries.setdefault("placement", {})
        hit = cache.get(id(replicas))
        if hit is not None and hit[0] is replicas:
            return hit[1]
        if len(cache) > 50_000:
            cache.clear()
            self.placement_ids.clear()
        names = tuple(r.device for r in replicas)
        shares = tuple(r.share for r in replicas)
        counts = tuple(r.accumulate for r in replicas)  # accumulation pieces: another placement
        key = (names, shares) if all(k == 1 for k in counts) else (names, shares, counts)
        out = (self._number(key), names, shares, self._number(names))
        cache[id(replicas)] = (replicas, out)
        return out
