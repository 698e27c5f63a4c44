"""Each sync method's own code path (execute/collectives.py) on real gloo processes.

Four local ranks run every method on seeded per-rank tensors and write what they ended with;
the test checks each against the plain sum (all members bit-identical), and the parameter
server against single-process optimizer steps on the summed gradient.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
SIZES = (1001, 3, 64)   # uneven ring chunks; fewer elements than members (empty chunks)

# (name, method, members in method order, nodes)
ALLREDUCE_CASES = [
    ("ring-all", "ring", [2, 0, 3, 1], None),
    ("ring-pair", "ring", [3, 1], None),
    ("tree-all", "tree", [0, 1, 2, 3], None),
    ("tree-subset", "tree", [3, 0, 2], None),
    ("hier-two-nodes", "hierarchical", [0, 1, 2, 3], [[0, 1], [2, 3]]),
    ("hier-uneven", "hierarchical", [0, 1, 2, 3], [[3], [1, 0, 2]]),
    ("hier-one-node", "hierarchical", [1, 2], [[1, 2]]),
]
PS_CASES = [  # (name, server, replicas, optimizer)
    ("ps-server-without-replica-sgd", 3, [0, 1, 2], "sgd"),
    ("ps-server-is-replica-adamw", 1, [0, 1, 2, 3], "adamw"),
]
PS_STEPS = 3


def grad_of(rank: int, size: int, step: int = 0) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + 7 * size + step))


def optimizer(kind: str):
    def make(params):
        return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.AdamW(params, lr=0.01)
    return make


def _worker(rank: int, port: int, out_dir: str) -> None:
    from heterog.execute.collectives import ParameterServer, ProcessGroupCache, allreduce_sum
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    groups = ProcessGroupCache(timeout_s=60)
    groups.create_all([m for _, _, m, _ in ALLREDUCE_CASES] + [sorted(set(r) | {s}) for _, s, r, _ in PS_CASES])
    out = {}
    for name, method, members, nodes in ALLREDUCE_CASES:
        if rank in members:
            for size in SIZES:
                flat = grad_of(rank, size)
                allreduce_sum(flat, members, method, nodes, groups)
                out[(name, size)] = flat
    for name, server, replicas, kind in PS_CASES:
        if rank not in replicas and rank != server:
            continue
        ps = ParameterServer(server=server, replicas=replicas, groups=groups, make_optimizer=optimizer(kind))
        params = torch.linspace(-1, 1, 50)
        for step in range(PS_STEPS):
            grad = grad_of(rank, 50, step) if rank in replicas else torch.zeros(50)
            params = ps.step(grad, params)
        out[(name, "params")] = params
        out[(name, "has_optimizer")] = ps.optimizer is not None
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("collectives")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,method,members,nodes", ALLREDUCE_CASES, ids=[c[0] for c in ALLREDUCE_CASES])
def test_allreduce_method_equals_the_plain_sum_on_every_member(results, name, method, members, nodes):
    for size in SIZES:
        want = sum(grad_of(r, size) for r in sorted(members))
        got = [results[r][(name, size)] for r in members]
        assert torch.allclose(got[0], want, rtol=1e-6, atol=1e-6), (name, size)
        assert all(torch.equal(g, got[0]) for g in got), f"{name}: members disagree bit for bit"
    for r in range(WORLD):
        if r not in members:
            assert (name, SIZES[0]) not in results[r]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,server,replicas,kind", PS_CASES, ids=[c[0] for c in PS_CASES])
def test_parameter_server_equals_single_process_steps_on_the_summed_gradient(results, name, server,
                                                                              replicas, kind):
    ref = torch.nn.Parameter(torch.linspace(-1, 1, 50))
    opt = optimizer(kind)([ref])
    for step in range(PS_STEPS):
        ref.grad = sum(grad_of(r, 50, step) for r in replicas)
        opt.step()
    for r in sorted(set(replicas) | {server}):
        got = results[r][(name, "params")]
        assert torch.allclose(got, ref.detach(), rtol=1e-6, atol=1e-7), (name, r)
        # only the server keeps optimizer state
        assert results[r][(name, "has_optimizer")] == (r == server)
