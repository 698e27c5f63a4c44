"""Where a plan's ranks run on this machine: which devices become ranks, how fast each
emulated device computes, which GPU each rank takes, and whether the links between the
cluster's nodes are shaped. Decided here, before any process starts; the launcher carries it
out (execute/launcher.py, netns.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from heterog.errors import PlanError
from heterog.execute.device import nccl_env
from heterog.execute.netns import LinkShaping, ShapingUnavailable
from heterog.execute.torchrun import local_gpu_indices
from heterog.hardware.cluster import Cluster
from heterog.ir.plan import Plan
from heterog.ir.run_request import DeviceLayout, LinkConfig
from heterog.ir.run_result import LinkShapingRecord
from heterog.orchestrate import cluster_of, rank_devices

MAX_LOCAL_RANKS = 16
SHAPING_METHOD = "netns+veth+tc-tbf"


def local_ranks(plan: Plan) -> tuple[Cluster, tuple[str, ...]]:
    """(the plan's cluster, the devices of its ranks), refused when this machine's launcher
    cannot start that many processes."""
    cluster = cluster_of(plan)
    devices = rank_devices(plan, cluster)
    if len(devices) > MAX_LOCAL_RANKS:
        raise PlanError(
            f"the plan uses {len(devices)} devices; the local launcher runs at most "
            f"{MAX_LOCAL_RANKS} processes on one machine. Use --torchrun on a real cluster."
        )
    return cluster, devices


def local_gpus() -> int:
    """CUDA devices visible to this process (0 without a CUDA build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def emulated_slowdowns(
    plan: Plan, cluster: Cluster | None, devices: tuple[str, ...], emulated: bool
) -> dict[str, float]:
    """Each rank's compute slowdown: declared on emulated clusters; from peak FLOP/s when a
    real cluster is emulated (the fastest device runs at this CPU's speed)."""
    if cluster is None:
        return {}
    if cluster.kind == "emulated":
        return {d: cluster.device(d).slowdown for d in devices}
    if not emulated:
        if local_gpus() >= len(devices):
            return {}  # real GPUs: one rank per visible GPU, no pacing
        raise PlanError(
            f"the plan's cluster {cluster.name!r} is a real GPU cluster of {len(devices)} device(s) "
            f"({', '.join(sorted({cluster.device(d).gpu_type for d in devices}))}) and this machine has "
            f"{local_gpus()} visible GPU(s). Run it where its GPUs are (--torchrun prints the per-node "
            f"commands), or use --emulated to emulate it here with CPU processes (each device paced "
            f"by its speed relative to the fastest)."
        )
    key = "fp32" if plan.precision == "fp32" else "bf16"
    peak = {d: cluster.gpu(d).peak_flops_per_s.get(key) or cluster.gpu(d).peak_flops_per_s["fp32"] for d in devices}
    top = max(peak.values())
    return {d: top / peak[d] for d in devices}


def on_gpus(cluster: Cluster, devices: tuple[str, ...], emulated: bool) -> bool:
    """A local run goes on GPUs when the plan's cluster is real, not emulated, and this
    machine shows a GPU for every rank (rank r on cuda:r)."""
    return cluster.kind != "emulated" and not emulated and local_gpus() >= len(devices) > 0


def gpu_layout(
    cluster: Cluster, devices: tuple[str, ...], *, share: bool = False
) -> tuple[tuple[int, ...], bool, str | None]:
    """(each rank's GPU index on this machine, whether ranks share GPUs through host copies,
    a note). Devices of one node run on the GPUs they name (their positions in the node,
    torchrun.local_gpu_indices); devices of several nodes run one per GPU in rank order;
    with `share`, more ranks than GPUs take the GPUs in turn (gloo, host staging)."""
    visible = local_gpus()
    nodes = {cluster.node_of[d] for d in devices}
    if len(nodes) == 1:
        node = cluster.node_index[next(iter(nodes))]
        indices = local_gpu_indices(node.devices, devices)
        if max(indices) < visible:
            return tuple(indices), False, None
    if len(devices) <= visible:
        return (
            tuple(range(len(devices))),
            False,
            ("the plan's devices span several nodes: rank r runs on this machine's cuda:r" if len(nodes) > 1 else None),
        )
    if not share:
        raise PlanError(f"the plan has {len(devices)} ranks and this machine {visible} GPU(s).")
    return (
        tuple(r % visible for r in range(len(devices))),
        True,
        f"{len(devices)} ranks share {visible} GPU(s): NCCL refuses two ranks on one GPU, so they talk "
        f"through gloo with host copies (correct, not fast)",
    )


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """How one plan's ranks start here (their RankSpec, execute/spec.py, takes these fields)."""

    devices: tuple[str, ...]
    slowdowns: dict[str, float] = field(default_factory=dict)
    cuda: bool = False
    cuda_indices: tuple[int, ...] = ()
    host_staging: bool = False
    gpu_types: dict[str, str] = field(default_factory=dict)
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def rank_layout(plan: Plan, cluster: Cluster, devices: tuple[str, ...], layout: DeviceLayout) -> RankLayout:
    """Pacing, GPUs and NCCL settings of `plan`'s ranks on this machine."""
    shared = layout.share_gpus and not layout.emulated and cluster.kind != "emulated"
    shared = shared and 0 < local_gpus() < len(devices)
    slowdowns = {} if shared else emulated_slowdowns(plan, cluster, devices, layout.emulated)
    notes: list[str] = []
    if layout.emulated and cluster.kind != "emulated":
        notes.append(
            f"{cluster.name} emulated with CPU processes paced by relative peak FLOP/s; the "
            f"prediction is for the real devices, so compare speed ratios, not times"
        )
    if not (shared or on_gpus(cluster, devices, layout.emulated)):
        return RankLayout(devices=devices, slowdowns=slowdowns, notes=tuple(notes))
    env, note = nccl_env({cluster.device(d).gpu_type for d in devices}, layout.nccl or None)
    indices, staging, layout_note = gpu_layout(cluster, devices, share=shared)
    return RankLayout(
        devices=devices,
        slowdowns=slowdowns,
        cuda=True,
        cuda_indices=indices,
        host_staging=staging,
        gpu_types={d: cluster.device(d).gpu_type for d in devices},
        env={r: env for r in range(len(devices))},
        notes=(*notes, *(n for n in (note, layout_note) if n)),
    )


@dataclass(frozen=True, kw_only=True)
class ShapedLinks:
    """The processes' command prefixes and environments in their namespaces (per rank or
    process index), the address of the first, and what was done."""

    wrap: dict[int, list[str]] = field(default_factory=dict)
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    record: LinkShapingRecord = field(default_factory=lambda: LinkShapingRecord(enabled=False, reason="not requested"))
    note: str | None = None  # for the run's notes: shaping was wanted and could not be done


def shape_links(
    stack: contextlib.ExitStack, cluster: Cluster, devices: tuple[str, ...], links: LinkConfig
) -> ShapedLinks:
    """One process per device in network namespaces with the cluster's NIC bandwidths, when
    wanted (LinkConfig.shape; by default on emulated clusters) and possible (root, `ip`,
    `tc`); the namespaces live as long as `stack`. Not shaped: why, in the record."""
    want = links.shape if links.shape is not None else cluster.kind == "emulated"
    if not want:
        return ShapedLinks()
    if len({cluster.node_of[d] for d in devices}) == 1:
        return ShapedLinks(
            record=LinkShapingRecord(enabled=False, reason="the plan's devices share one node: no link to shape")
        )
    try:
        shaping = stack.enter_context(LinkShaping(cluster=cluster, devices=devices))
    except ShapingUnavailable as e:
        return ShapedLinks(record=LinkShapingRecord(enabled=False, reason=str(e)), note=f"links not shaped: {e}")
    return ShapedLinks(
        wrap=shaping.wrap,
        env=shaping.env,
        master_addr=shaping.master_addr,
        record=LinkShapingRecord(enabled=True, method=SHAPING_METHOD, nic_bandwidth_bytes_per_s=dict(shaping.links)),
    )
