"""Running a plan on a real cluster: one torchrun command per node, each rank on the GPU its
plan device names (the spec every rank reads is a RankSpec with `torchrun` set, execute/spec.py)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def local_gpu_indices(node_devices: Sequence[str], used: Sequence[str]) -> list[int]:
    """The GPU index on its node of each used device: its position among the node's devices,
    which a cluster file lists in the order of the node's GPUs (CUDA_VISIBLE_DEVICES order)."""
    return [list(node_devices).index(d) for d in used]


def torchrun_commands(
    *,
    spec_path: str,
    node_devices: list[list[str]],
    master_addr: str,
    master_port: int = 29500,
    env: dict[str, str] | None = None,
    visible: list[list[int]] | None = None,
) -> list[str]:
    """One torchrun command per node; rank order follows node order, then device order. `env`
    (e.g. one NCCL algorithm for unlike GPUs) prefixes every command; `visible[i]`, node i's
    GPUs the plan uses, becomes its CUDA_VISIBLE_DEVICES, so local rank k runs on the k-th of
    them — the GPU its plan device names, also when the plan leaves some of the node's out."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    out = []
    for i, devs in enumerate(node_devices):
        gpus = [f"CUDA_VISIBLE_DEVICES={','.join(map(str, visible[i]))}"] if visible else []
        out.append(
            " ".join(
                [
                    *prefix,
                    *gpus,
                    "torchrun",
                    f"--nnodes={len(node_devices)}",
                    f"--node-rank={i}",
                    f"--nproc-per-node={len(devs)}",
                    f"--master-addr={shlex.quote(master_addr)}",
                    f"--master-port={master_port}",
                    "-m",
                    "heterog.execute.worker",
                    shlex.quote(spec_path),
                ]
            )
        )
    return out
