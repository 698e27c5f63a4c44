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
SIZES = (1001, 3, 64)  # uneven ring chunks; fewer elements than members (empty chunks)

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
# (name, members in ring order, each member's piece): uneven, one empty, one of a single element
SHARD_CASES = [
    ("shards-all", [2, 0, 3, 1], [500, 0, 300, 201]),
    ("shards-pair", [3, 1], [1, 1000]),
]
PS_STEPS = 3
SKIPPED_STEP = 1  # the deferred server skips this step's update (an fp16 overflow)


def grad_of(rank: int, size: int, step: int = 0) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + 7 * size + step))


def optimizer(kind: str):
    def make(params):
        return torch.optim.SGD(params, lr=0.1) if kind == "sgd" else torch.optim.AdamW(params, lr=0.01)

    return make


def _worker(rank: int, port: int, out_dir: str) -> None:
    from heterog.execute.collectives import (
        ParameterServer,
        ProcessGroupCache,
        allreduce_sum,
        ring_all_gather,
        ring_reduce_scatter,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    groups = ProcessGroupCache(timeout_s=60)
    groups.create_all(
        [m for _, _, m, _ in ALLREDUCE_CASES]
        + [sorted(set(r) | {s}) for _, s, r, _ in PS_CASES]
        + [m for _, m, _ in SHARD_CASES]
    )
    out = {}
    for name, members, sizes in SHARD_CASES:  # the halves alone, with uneven pieces
        if rank in members:
            flat = grad_of(rank, sum(sizes))
            ring_reduce_scatter(flat, sizes, members, groups.link(members))
            i = members.index(rank)
            lo = sum(sizes[:i])
            out[(name, "piece")] = flat[lo : lo + sizes[i]].clone()
            gathered = torch.full((sum(sizes),), float("nan"))
            gathered[lo : lo + sizes[i]] = float(rank)
            ring_all_gather(gathered, sizes, members, groups.link(members))
            out[(name, "gathered")] = gathered
    for name, method, members, nodes in ALLREDUCE_CASES:
        if rank in members:
            for size in SIZES:
                flat = grad_of(rank, size)
                allreduce_sum(flat, members, method, nodes, groups)
                out[(name, size)] = flat
    for name, server, replicas, kind in PS_CASES:
        if rank not in replicas and rank != server:
            continue
        ps = ParameterServer(server=server, replicas=replicas, groups=groups, make_optimizer=optimizer(kind), numel=50)
        params = torch.linspace(-1, 1, 50)
        for step in range(PS_STEPS):
            grad = grad_of(rank, 50, step) if rank in replicas else torch.zeros(50)
            params = ps.step(grad, params)
        out[(name, "params")] = params
        out[(name, "has_optimizer")] = ps.optimizer is not None
        # the fp16 form: push, every member agrees to skip step 1, pull only when applied
        deferred = ParameterServer(
            server=server, replicas=replicas, groups=groups, make_optimizer=optimizer(kind), numel=50
        )
        params = torch.linspace(-1, 1, 50)
        for step in range(PS_STEPS):
            deferred.push(grad_of(rank, 50, step) if rank in replicas else torch.zeros(50), params)
            if step != SKIPPED_STEP:
                params = deferred.pull().clone()
        out[(name, "deferred")] = params
    out["scratch_buffers"] = len(groups.scratch.held)  # every call received into one buffer
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
        assert results[r]["scratch_buffers"] == 1, "receive buffers are reused from call to call"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,members,sizes", SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
def test_uneven_reduce_scatter_and_all_gather(results, name, members, sizes):
    """Member i of the ring ends the reduce-scatter with the sum of piece i; the all-gather
    gives every member every member's piece."""
    total = sum(grad_of(r, sum(sizes)) for r in sorted(members))
    want = torch.cat([torch.full((n,), float(r)) for r, n in zip(members, sizes)])
    for i, r in enumerate(members):
        lo = sum(sizes[:i])
        assert torch.allclose(results[r][(name, "piece")], total[lo : lo + sizes[i]], rtol=1e-6, atol=1e-6)
        assert torch.equal(results[r][(name, "gathered")], want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,server,replicas,kind", PS_CASES, ids=[c[0] for c in PS_CASES])
def test_parameter_server_equals_single_process_steps_on_the_summed_gradient(results, name, server, replicas, kind):
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


# -- ProgramSync: the sync driver for a lowered Program, on 3 ranks -----------------------
# block 0: group 0 on ranks 0, 1 (ring); block 1: group 1 on ranks 1, 2, served by rank 0
# (ps, no replica there); parameter "tied" is read by both groups, so ranks 0, 1, 2 hold it.


def _program():
    from types import SimpleNamespace

    from heterog.lower.program import Collective

    devices = ("d0", "d1", "d2")
    blocks = (
        SimpleNamespace(groups=(0,), devices=("d0", "d1"), label="block 0"),
        SimpleNamespace(groups=(1,), devices=("d1", "d2"), label="block 1"),
    )
    c0 = Collective(op=0, block=0, method="ring", members=("d0", "d1"), server=None, nodes=(), nbytes=0.0)
    c1 = Collective(op=1, block=1, method="ps", members=("d1", "d2"), server="d0", nodes=(), nbytes=0.0)
    instructions = {"d0": (c0, c1), "d1": (c0, c1), "d2": (c1,)}
    return SimpleNamespace(
        devices=devices, blocks=blocks, instructions=instructions, rank_of=lambda: {d: r for r, d in enumerate(devices)}
    )


def _flow(rank: int):
    from heterog.cut.dataflow import Dataflow

    names = {0: ("a", "tied"), 1: ("b", "tied")}
    held = {0: {0}, 1: {0, 1}, 2: {1}}[rank]
    params = {n: torch.nn.Parameter(torch.full((5,), 1.0 + i)) for i, n in enumerate(["a", "b", "tied"])}
    for n, p in params.items():
        if not any(n in names[g] for g in held):
            p.data = torch.empty(0)
        else:
            p.grad = grad_of(rank, 5, "abtied".index(n[0]) + 1)
    return Dataflow(
        inputs=(),
        stages=(),
        projections={},
        owner={},
        output="",
        params_of_group={g: [(n, params[n]) for n in names[g]] for g in held},
        param_names=names,
        param_numel={n: 5 for n in params},
        param_shape={n: torch.Size([5]) for n in params},
        param_by_name=params,
        tied={"tied": (0, 1)},
    )


def _program_worker(rank: int, port: int, out_dir: str) -> None:
    from heterog.execute.sync import ProgramSync

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    flow = _flow(rank)
    sync = ProgramSync(program=_program(), flow=flow, rank=rank, optimizer="sgd", timeout_s=60)
    tied_storage = flow.param_by_name["tied"].grad.data_ptr()
    for ins in _program().instructions[f"d{rank}"]:
        sync.launch(ins)
    sync.finish()
    sync.sum_tied_gradients()
    out = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in flow.param_by_name.items()}
    # a one-parameter bucket is summed in its own gradient, not copied out and back
    out["tied_summed_in_place"] = flow.param_by_name["tied"].grad.data_ptr() == tied_storage
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_program_sync_runs_each_blocks_method_and_sums_tied_gradients_over_all_holders(tmp_path):
    mp.spawn(_program_worker, args=(_free_port(), str(tmp_path)), nprocs=3, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    g = lambda r, n: grad_of(r, 5, "abtied".index(n[0]) + 1)  # noqa: E731
    # ring over ranks 0, 1 for "a"
    for r in (0, 1):
        assert torch.allclose(got[r]["a"][1], g(0, "a") + g(1, "a"))
    # ps served by rank 0 (SGD at workload.SGD_LR): replicas 1, 2 get the new
    # parameters and no gradient, so their local optimizer leaves them alone
    from heterog.workload import SGD_LR

    want_b = torch.full((5,), 2.0) - SGD_LR * (g(1, "b") + g(2, "b"))
    for r in (1, 2):
        value, grad = got[r]["b"]
        assert torch.allclose(value, want_b) and grad is None
    # the tied parameter's gradient: every holder's local gradient, summed on all three
    for r in (0, 1, 2):
        assert torch.allclose(got[r]["tied"][1], g(0, "tied") + g(1, "tied") + g(2, "tied"))
        assert got[r]["tied_summed_in_place"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,server,replicas,kind", PS_CASES, ids=[c[0] for c in PS_CASES])
def test_deferred_parameter_server_skips_a_step_on_every_member(results, name, server, replicas, kind):
    """push / pull apart (fp16): a step whose pull every member skips leaves the parameters
    and the optimizer as they were; the other steps equal single-process steps."""
    ref = torch.nn.Parameter(torch.linspace(-1, 1, 50))
    opt = optimizer(kind)([ref])
    for step in range(PS_STEPS):
        if step == SKIPPED_STEP:
            continue
        ref.grad = sum(grad_of(r, 50, step) for r in replicas)
        opt.step()
    for r in sorted(set(replicas) | {server}):
        assert torch.allclose(results[r][(name, "deferred")], ref.detach(), rtol=1e-6, atol=1e-7), (name, r)
