"""Communication times over a Cluster's real paths (alpha-beta model, uncontended by other
traffic; the simulator adds contention between concurrent transfers).

Every collective is timed as a sequence of steps; in each step a set of transfers runs at
once, and the step lasts as long as its most loaded link needs (bytes on the link / its
bandwidth) plus the largest path latency. Links shared by several transfers of the same step
(two ring edges leaving one node through its NIC) divide their bandwidth. This is how a ring
across two nodes ends up limited by the NIC rather than by NVLink.

Formulas (n members, N bytes per member):
- ring all-reduce: 2(n-1) steps of N/n each — time 2(n-1)/n · N/B + 2(n-1)·α
  (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005);
- reduce-scatter, all-gather: (n-1) steps of N/n (Thakur et al. 2005); with uneven pieces
  (sharded state, member i holding the fraction f_i) every step moves each piece but one,
  each over its own ring edge, so a step lasts as long as its slowest edge with its piece:
  Σ_k max_i (α + f_{piece(i,k)} N / B_i) on a ring of equal links (shard_collective_time_s);
- tree all-reduce: pipelined double binary tree as in NCCL ≥ 2.4 (Sanders, Speck & Träff
  2009): each tree carries N/2 up (reduce) then down (broadcast): ≈ 2·N/B + 2⌈log2 n⌉·α;
- broadcast / reduce: pipelined binomial tree, N/B + ⌈log2 n⌉·α;
- hierarchical all-reduce: intra-node reduce-scatter, an all-reduce of each shard across
  node leaders (all shards of a node share its NIC), intra-node all-gather
  (the two-level scheme of Horovod/NCCL "hierarchical allreduce");
- parameter server: every other replica pushes N to the server, then pulls N back; the
  server's port and NIC carry (n-1)·N each way (Li et al., OSDI 2014).

Every link's bandwidth and latency are read through `pcie.link_rate`: the cluster's figures,
except a calibrated GPU type's PCIe port, which runs at what NCCL was measured to reach
through it (cost/pcie.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from heterog.cost.pcie import link_rate
from heterog.errors import PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import shard_piece

RUN_BLOCK = 256  # _ring_max: runs of one bandwidth class handled together (arrays of runs × steps)
METHODS = (SyncMethod.RING, SyncMethod.TREE, SyncMethod.HIERARCHICAL)
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


_PROBE_BYTES = (2.0**20, 2.0**21)


def affine_in_bytes(cache: dict, key: tuple, time_s: Callable[[float], float]) -> tuple[float, float]:
    """(fixed s, s per byte) of a communication time that is affine in its bytes (every
    function below is, for a fixed set of devices): two probes, once per key, then exact."""
    coeffs = cache.get(key)
    if coeffs is None:
        (b1, b2) = _PROBE_BYTES
        t1, t2 = time_s(b1), time_s(b2)
        per_byte = (t2 - t1) / (b2 - b1)
        coeffs = cache[key] = (t1 - per_byte * b1, per_byte)
    return coeffs


def path_latency_s(cluster: Cluster, src: str, dst: str) -> float:
    """The summed latency of the links from `src` to `dst` (pcie.link_rate)."""
    return sum(link_rate(cluster, link)[1] for link in cluster.path(src, dst))


def p2p_time_s(cluster: Cluster, nbytes: float, src: str, dst: str) -> float:
    """latency + bytes / bottleneck bandwidth over Cluster.path (0 on the same device)."""
    if src == dst or nbytes <= 0:
        return 0.0
    rates = [link_rate(cluster, link) for link in cluster.path(src, dst)]
    return sum(lat for _, lat in rates) + nbytes / min(bw for bw, _ in rates)


def step_time_s(cluster: Cluster, transfers: Iterable[tuple[str, str, float]]) -> float:
    """One step of concurrent transfers (src, dst, bytes): the most loaded link sets the pace."""
    load: dict[str, float] = defaultdict(float)
    latency = 0.0
    for src, dst, nbytes in transfers:
        if src == dst or nbytes <= 0:
            continue
        path = cluster.path(src, dst)
        for link in path:
            load[link] += nbytes
        latency = max(latency, path_latency_s(cluster, src, dst))
    if not load:
        return 0.0
    return latency + max(b / link_rate(cluster, link)[0] for link, b in load.items())


def ring_order(cluster: Cluster, devices: Sequence[str]) -> list[str]:
    """Members ordered node by node, so the ring leaves each node once (what NCCL does)."""
    node_rank = {n.name: i for i, n in enumerate(cluster.nodes)}
    return sorted(dict.fromkeys(devices), key=lambda d: (node_rank[cluster.node_of[d]], cluster.device_index[d]))


def _ring_step_s(cluster: Cluster, ring: list[str], chunk_bytes: float) -> float:
    n = len(ring)
    return step_time_s(cluster, ((ring[i], ring[(i + 1) % n], chunk_bytes) for i in range(n)))


def ring_collective_time_s(cluster: Cluster, op: str, nbytes: float, devices: Sequence[str]) -> float:
    ring = ring_order(cluster, devices)
    n = len(ring)
    if n <= 1 or nbytes <= 0:
        return 0.0
    step = _ring_step_s(cluster, ring, nbytes / n)
    if op == "allreduce":
        return 2 * (n - 1) * step
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) * step
    if op in ("broadcast", "reduce"):
        # pipelined chain: the data crosses n-1 hops, chunks overlap: ≈ N/B + (n-1) α
        return tree_collective_time_s(cluster, op, nbytes, devices)
    raise PlanError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVES)}.")


def _tree_edges(cluster: Cluster, devices: Sequence[str]) -> tuple[list[tuple[str, str]], int]:
    """Parent → child edges of the tree NCCL builds: a binary tree over the nodes' first
    devices (heap layout) and a chain inside each node; and the tree's depth in hops."""
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in ring_order(cluster, devices):
        by_node[cluster.node_of[d]].append(d)
    groups = list(by_node.values())
    leaders = [g[0] for g in groups]
    edges = [(leaders[(i - 1) // 2], leaders[i]) for i in range(1, len(leaders))]
    for g in groups:
        edges += [(g[i], g[i + 1]) for i in range(len(g) - 1)]
    depth = (math.ceil(math.log2(len(leaders) + 1)) - 1) + max(len(g) for g in groups) - 1
    return edges, max(depth, 1)


def tree_collective_time_s(cluster: Cluster, op: str, nbytes: float, devices: Sequence[str]) -> float:
    if op in ("reduce_scatter", "all_gather"):
        return ring_collective_time_s(cluster, op, nbytes, devices)
    if op not in COLLECTIVES:
        raise PlanError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVES)}.")
    if len(set(devices)) <= 1 or nbytes <= 0:
        return 0.0
    edges, depth = _tree_edges(cluster, devices)
    # pipelined: the bandwidth term is one pass of the data over the tree's busiest link
    # (all edges active at once); the latency term is the depth.
    # double binary tree (all-reduce): two trees each carry N/2 and each device is internal
    # in at most one, so modelling one tree whose edges carry N/2 gives an internal device's
    # port N per direction (Sanders et al. 2009). A single pipelined tree carries N per edge.
    per_edge = nbytes / 2 if op == "allreduce" else nbytes
    down = step_time_s(cluster, ((p, c, per_edge) for p, c in edges))
    up = step_time_s(cluster, ((c, p, per_edge) for p, c in edges))
    max_lat = max(path_latency_s(cluster, p, c) for p, c in edges)
    bw_down, bw_up = down - max_lat, up - max_lat
    if op == "allreduce":
        return bw_up + bw_down + 2 * depth * max_lat
    if op == "broadcast":
        return bw_down + depth * max_lat
    return bw_up + depth * max_lat  # reduce


def hierarchical_collective_time_s(cluster: Cluster, op: str, nbytes: float, devices: Sequence[str]) -> float:
    """Intra-node reduce-scatter → inter-node ring all-reduce of each shard → intra all-gather.
    Nodes proceed in parallel; each phase lasts as long as its slowest node."""
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in ring_order(cluster, devices):
        by_node[cluster.node_of[d]].append(d)
    groups = list(by_node.values())
    if len(groups) == 1 or op not in ("allreduce", "reduce_scatter", "all_gather"):
        return ring_collective_time_s(cluster, op, nbytes, devices)
    intra = max(ring_collective_time_s(cluster, "reduce_scatter", nbytes, g) for g in groups)
    k_max = max(len(g) for g in groups)
    # Inter-node: shard s of every node is all-reduced in a ring over the nodes' s-th
    # devices; all k rings run at once and share each node's NIC, which therefore carries
    # the whole buffer — as one ring over node leaders with N bytes.
    rings = [[g[s] for g in groups if s < len(g)] for s in range(k_max)]
    m = len(groups)
    transfers = []
    for ring in rings:
        if len(ring) > 1:
            transfers += [(ring[i], ring[(i + 1) % len(ring)], nbytes / k_max / m) for i in range(len(ring))]
    inter_step = step_time_s(cluster, transfers)
    if op == "allreduce":
        return 2 * intra + 2 * (m - 1) * inter_step
    return intra + (m - 1) * inter_step


def collective_time_s(
    cluster: Cluster, op: str, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING
) -> float:
    if op not in COLLECTIVES:
        raise PlanError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVES)}.")
    if method == SyncMethod.RING:
        return ring_collective_time_s(cluster, op, nbytes, devices)
    if method == SyncMethod.TREE:
        return tree_collective_time_s(cluster, op, nbytes, devices)
    if method == SyncMethod.HIERARCHICAL:
        return hierarchical_collective_time_s(cluster, op, nbytes, devices)
    raise PlanError(
        f"unknown collective method {method!r}; use one of {', '.join(METHODS)} (or sync 'ps' with ps_sync_time_s)."
    )


def shard_collective_time_s(
    cluster: Cluster, op: str, nbytes: float, devices: Sequence[str], fractions: Sequence[float]
) -> float:
    """A ring reduce-scatter or all-gather of a buffer of `nbytes` whose pieces are uneven: the
    member devices[i] owns the fraction fractions[i] of it. The members go round in ring order;
    each of the n−1 steps runs all its transfers at once (step_time_s: shared links divide
    their bandwidth) and lasts as long as the slowest."""
    if nbytes <= 0:
        return 0.0
    fixed_s, per_byte_s = shard_collective_coefficients(cluster, op, devices, fractions)
    return fixed_s + per_byte_s * nbytes


def shard_collective_coefficients(
    cluster: Cluster, op: str, devices: Sequence[str], fractions: Sequence[float]
) -> tuple[float, float]:
    """(fixed s, s per byte of the buffer) of shard_collective_time_s: every step's loads are
    proportional to the buffer, so its latency and its busiest link's time per byte add up.
    At step k ring edge i sends piece shard_piece(i, k); its edges keep their paths. When no
    link carries two edges (a ring that leaves each node once: the usual case), a step's
    busiest link is its edge with the largest piece × 1 / bandwidth, found per bandwidth class
    by scanning the pieces largest first (`_ring_max`) — linear in the members in practice,
    where arrays of every step × edge take seconds and gigabytes at 4096 members."""
    if op not in ("reduce_scatter", "all_gather"):
        raise PlanError(f"a sharded collective is a reduce_scatter or an all_gather, not {op!r}.")
    share = dict(zip(devices, fractions))
    ring = ring_order(cluster, devices)
    n = len(ring)
    if n <= 1:
        return 0.0, 0.0
    owned = np.array([share[d] for d in ring], dtype=float)
    if not (owned > 0).any():
        return 0.0, 0.0
    paths = [cluster.path(ring[i], ring[(i + 1) % n]) for i in range(n)]
    edge_latency_s = np.array([sum(link_rate(cluster, link)[1] for link in path) for path in paths])
    # edge i sends piece (i − k − lag) mod n at step k (ir/plan.py shard_piece)
    lag = (-int(shard_piece(op, 0, 0, n))) % n
    # every piece is sent at every step (the edges send a permutation of them): a step with
    # any non-empty piece waits for the slowest edge that sends one
    latency_s = _ring_max((owned > 0).astype(float), edge_latency_s, lag)
    uses = [link for path in paths for link in path]
    if len(set(uses)) == len(uses):  # no link carries two edges
        inverse_bw = np.array([max((1.0 / link_rate(cluster, link)[0] for link in p), default=0.0) for p in paths])
        per_byte_s = _ring_max(owned, inverse_bw, lag)
    else:
        per_byte_s = _shared_link_steps(cluster, owned, paths, lag)
    return float(latency_s.sum()), float(per_byte_s.sum())


def _ring_max(values: np.ndarray, weight: np.ndarray, lag: int) -> np.ndarray:
    """For every step k of n − 1: max over edges i of values[(i − k − lag) mod n] · weight[i].
    Per distinct weight, its edges form runs of consecutive ring positions (a node's devices
    are consecutive, so a few hundred runs at 4096 members); a run [a, a + L) sends the pieces
    of one circular window [a − k − lag, a − k − lag + L), whose maximum a sparse table gives
    for every step at once."""
    n = len(values)
    steps = np.arange(n - 1)
    table = [np.concatenate([values, values])]  # table[p][x]: max of the doubled values[x : x + 2^p]
    while 2 ** len(table) <= n:
        prev, half = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    out = np.zeros(n - 1)
    for w in np.unique(weight[weight > 0]):
        starts, lengths = _runs(weight == w)
        for a0 in range(0, len(starts), RUN_BLOCK):  # a block of runs at a time: bounded memory
            a, length = starts[a0 : a0 + RUN_BLOCK, None], lengths[a0 : a0 + RUN_BLOCK, None]
            level = np.log2(length).astype(np.int64)  # floor(log2 L): two windows of 2^level cover L
            first = (a - steps[None, :] - lag) % n
            last = first + length - (1 << level)
            best = np.zeros((len(a), n - 1))
            for p in np.unique(level):
                rows = np.flatnonzero(level[:, 0] == p)
                best[rows] = np.maximum(table[p][first[rows]], table[p][last[rows]])
            np.maximum(out, best.max(axis=0) * w, out=out)
    return out


def _runs(member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the maximal runs of True in a circular boolean array."""
    n = len(member)
    if member.all():
        return np.array([0]), np.array([n])
    edges = np.diff(member.astype(np.int8), prepend=member[-1].astype(np.int8))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    ends = np.where(ends < starts[0], ends + n, ends) if len(starts) else ends
    ends = np.sort(ends)
    return starts, (ends - starts)


def _shared_link_steps(cluster: Cluster, owned: np.ndarray, paths: Sequence[Sequence[str]], lag: int) -> np.ndarray:
    """Per step, the busiest link's seconds per byte when links carry several edges: each
    link's load summed over its edges, a block of steps at a time (bounded memory)."""
    n = len(owned)
    link_ids: dict[str, int] = {}
    edge_of_use, link_of_use = [], []
    for i, path in enumerate(paths):
        for link in path:
            edge_of_use.append(i)
            link_of_use.append(link_ids.setdefault(link, len(link_ids)))
    by_link = np.argsort(np.array(link_of_use, dtype=np.int64), kind="stable")
    links_sorted = np.array(link_of_use, dtype=np.int64)[by_link]
    edges_sorted = np.array(edge_of_use, dtype=np.int64)[by_link]
    starts = np.flatnonzero(np.r_[True, links_sorted[1:] != links_sorted[:-1]])
    inverse_bw = 1.0 / np.array([link_rate(cluster, link)[0] for link in link_ids])[links_sorted[starts]]
    out = np.zeros(n - 1)
    chunk = max(1, 2**22 // max(len(edges_sorted), 1))
    for k0 in range(0, n - 1, chunk):
        ks = np.arange(k0, min(n - 1, k0 + chunk))
        sent = owned[(edges_sorted[None, :] - ks[:, None] - lag) % n]  # [step, use]
        load = np.add.reduceat(sent, starts, axis=1)  # [step, link]
        out[ks] = (load * inverse_bw[None, :]).max(axis=1)
    return out


def ps_sync_time_s(cluster: Cluster, nbytes: float, devices: Sequence[str], server: str) -> float:
    """Push every replica's gradient to `server` at once, then pull the parameters back."""
    others = [d for d in dict.fromkeys(devices) if d != server]
    if not others or nbytes <= 0:
        return 0.0
    push = step_time_s(cluster, ((d, server, nbytes) for d in others))
    pull = step_time_s(cluster, ((server, d, nbytes) for d in others))
    return push + pull


# What a cost model calls. Every collective time is affine in the bytes (each step: a latency
# plus the most loaded link's bytes over its bandwidth, the loads all proportional to the
# buffer), so each (op, method, members) is timed once at two sizes and interpolated exactly
# after. The caller owns `cache`; its keys name the members, not the cluster, so one cache
# serves one cluster per set of members.


def cached_collective_time_s(
    cache: dict, cluster: Cluster, op: str, nbytes: float, devices: Sequence[str], method: str = SyncMethod.RING
) -> float:
    if nbytes <= 0 or len(set(devices)) <= 1:
        return 0.0
    members = tuple(devices)
    fixed, per_byte = affine_in_bytes(
        cache, ("c", op, method, members), lambda b: collective_time_s(cluster, op, b, members, method)
    )
    return fixed + per_byte * nbytes


def cached_shard_collective_time_s(
    cache: dict, cluster: Cluster, op: str, nbytes: float, devices: Sequence[str], fractions: Sequence[float]
) -> float:
    if nbytes <= 0 or len(set(devices)) <= 1:
        return 0.0
    key = ("shard", op, tuple(devices), tuple(fractions))
    coeffs = cache.get(key)
    if coeffs is None:
        coeffs = cache[key] = shard_collective_coefficients(cluster, op, devices, fractions)
    return coeffs[0] + coeffs[1] * nbytes


def cached_ps_sync_time_s(cache: dict, cluster: Cluster, nbytes: float, devices: Sequence[str], server: str) -> float:
    if nbytes <= 0:
        return 0.0
    members = tuple(devices)
    fixed, per_byte = affine_in_bytes(
        cache, ("ps", server, members), lambda b: ps_sync_time_s(cluster, b, members, server)
    )
    return fixed + per_byte * nbytes
