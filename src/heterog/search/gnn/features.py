"""Features of a planning problem for the GNN policy, independent of the cluster's size.

HeteroG's node features held one profiled time per (replica count × device), so their width
grew with the cluster and a trained policy fit one cluster size. Here the cluster enters as
three tables whose widths are fixed, read per group, per device and per (group, device) pair,
so the same weights score any number of devices:

- group g: its share of the model's compute, parameters and activations, its position, its
  gradient-sync time over all devices relative to its compute, bytes crossing to the next group;
- device d: speed relative to the fastest, memory relative to the largest, its NIC and local
  link bandwidths (log), how many devices share its node;
- pair (g, d): g's compute time on d relative to the fastest device, g's memory need at an
  even share relative to d's memory, the whole model's need at an even share relative to d's
  memory, and the time to move g's gradients from d to the fastest device relative to g's compute.
All values are O(1): ratios, or logs of ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from heterog.ir.kinds import SyncMethod
from heterog.search.problem import Placement, Problem

GROUP_FEATURES = 9
DEVICE_FEATURES = 6
PAIR_FEATURES = 5


@dataclass(frozen=True, slots=True)
class Features:
    group: torch.Tensor  # [G, GROUP_FEATURES]
    device: torch.Tensor  # [n, DEVICE_FEATURES]
    pair: torch.Tensor  # [G, n, PAIR_FEATURES]
    edge_index: torch.Tensor  # [2, E] group graph, both directions
    node_of_device: torch.Tensor  # [n] node index of each device
    n_nodes: int


def _log_ratio(x: np.ndarray, ref: float) -> np.ndarray:
    return np.log10(np.maximum(x, 1e-30) / max(ref, 1e-30))


def group_times_s(prob: Problem, batch: float) -> np.ndarray:
    """[G, C] forward + backward time of each group on each device class at `batch` samples."""
    return prob.fwd[:, :, 0] + prob.bwd[:, :, 0] + (prob.fwd[:, :, 1] + prob.bwd[:, :, 1]) * batch


def _group_features(prob: Problem) -> np.ndarray:
    """[G, 9] per group: its share of the time, parameters and activations, its position, what
    syncing it over every device and sending its output cost against its compute, the sizes."""
    G, n = prob.n_groups, prob.n_devices
    B = float(prob.batch_size)
    t_full = group_times_s(prob, B)[:, prob.dev_class[prob.speed_order[0]]]
    total_t = max(t_full.sum(), 1e-30)
    act = prob.act_per_sample[:, 0] * B
    sync_all = np.array(
        [
            prob.sync_time_s(g, Placement(tuple(range(n)), tuple([1.0 / n] * n), SyncMethod.RING)) if n > 1 else 0.0
            for g in range(G)
        ]
    )
    cross = np.zeros(G)
    for (a, b), nbytes in prob.edges.items():
        if b == a + 1:
            cross[a] += nbytes.at(B)
    return np.stack(
        [
            t_full / total_t * G,
            prob.param_bytes / max(prob.param_bytes.sum(), 1.0) * G,
            act / max(act.sum(), 1.0) * G,
            np.arange(G) / max(G - 1, 1),
            np.log10(1 + sync_all / np.maximum(t_full / n, 1e-9)),
            np.log10(1 + cross / max(act.mean(), 1.0)),
            _log_ratio(t_full, total_t / G) / 3,
            np.full(G, math.log10(n) / 3),
            np.full(G, math.log10(B) / 3),
        ],
        axis=1,
    )


def _device_features(prob: Problem) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """([n, 6] per device: speed, memory, NIC and local link bandwidth, devices on its node,
    memory left after every group's state; each device's node index; the nodes' names)."""
    n = prob.n_devices
    speed = 1.0 / prob.device_time_per_sample_s
    mem = prob.memory_bytes
    node_names = sorted(set(prob.node_of_device), key=prob.node_of_device.index)
    node_idx = np.array([node_names.index(x) for x in prob.node_of_device])
    per_node = np.bincount(node_idx)
    nic = np.zeros(n)
    local = np.zeros(n)
    members: dict[int, list[int]] = {}
    for i in range(n):
        members.setdefault(int(node_idx[i]), []).append(i)
    for i in range(n):
        own = members[int(node_idx[i])]
        peer = next((j for j in own[:2] if j != i), None)
        other = members[1 if node_idx[i] == 0 else 0][0] if len(members) > 1 else None
        nic[i] = 1.0 / max(prob.pair_cost(i, other)[1], 1e-15) if other is not None else 1e12
        local[i] = 1.0 / max(prob.pair_cost(i, peer)[1], 1e-15) if peer is not None else 1e12
    df = np.stack(
        [
            speed / speed.max(),
            mem / mem.max(),
            np.log10(nic / 1e9) / 2,
            np.log10(local / 1e9) / 2,
            per_node[node_idx] / n,
            np.log10(np.maximum(mem - prob.persistent_bytes[:, prob.dev_class].sum(axis=0), 1.0) / mem.max()) / 3,
        ],
        axis=1,
    )
    return df, node_idx, node_names


def _pair_features(prob: Problem) -> np.ndarray:
    """[G, n, 5] per group and device: its time there at an even share against the fastest
    device's, the memory it and all groups need there, moving its gradient, the device's speed."""
    G, n = prob.n_groups, prob.n_devices
    even = float(prob.batch_size) / n
    fast = prob.speed_order[0]
    speed = 1.0 / prob.device_time_per_sample_s
    mem = prob.memory_bytes
    cls = prob.dev_class
    t_even = group_times_s(prob, even)[:, cls]  # [G, n]
    t_even_fast = group_times_s(prob, even)[:, prob.dev_class[fast]][:, None]
    need_g = prob.persistent_bytes[:, cls] + (prob.act_per_sample[:, 0] * even)[:, None]
    need_all = need_g.sum(axis=0, keepdims=True)
    per_byte = np.array([prob.pair_cost(d, fast)[1] if d != fast else 0.0 for d in range(n)])
    grad_move = prob.grad_bytes[:, None] * per_byte[None, :] / np.maximum(t_even_fast, 1e-9)
    return np.stack(
        [
            _log_ratio(t_even, 1.0) - _log_ratio(t_even_fast, 1.0),
            need_g / mem[None, :],
            np.broadcast_to(need_all / mem[None, :], (G, n)),
            np.log10(1 + grad_move),
            np.broadcast_to((speed / speed.sum())[None, :] * n, (G, n)),
        ],
        axis=2,
    )


def build_features(prob: Problem) -> Features:
    """The policy's inputs for one problem: group, device and (group, device) pair features and
    the graph's edges both ways."""
    gf = _group_features(prob)
    df, node_idx, node_names = _device_features(prob)
    pf = _pair_features(prob)
    src = [a for (a, b) in prob.edges] + [b for (a, b) in prob.edges]
    dst = [b for (a, b) in prob.edges] + [a for (a, b) in prob.edges]
    f32 = torch.float32
    return Features(
        group=torch.tensor(np.nan_to_num(gf), dtype=f32),
        device=torch.tensor(np.nan_to_num(df), dtype=f32),
        pair=torch.tensor(np.nan_to_num(np.clip(pf, -10, 10)), dtype=f32),
        edge_index=torch.tensor([src, dst], dtype=torch.long).reshape(2, -1),
        node_of_device=torch.tensor(node_idx, dtype=torch.long),
        n_nodes=len(node_names),
    )
