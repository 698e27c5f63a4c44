"""Point-to-point transfers of sample ranges between ranks, non-blocking on the send side.

Gloo's blocking send waits for the matching receive, and a hand-written pipeline with
blocking sends deadlocks (torch.distributed.send blocks until the matching recv on gloo). Here every send is an `isend` whose handle is kept
until the end of the step, or until the caller knows it arrived (`release`: a forward
activation once its gradient is back), and only receives block — each with the run's timeout. Every
rank walks the same global order of events (Executor.events: forwards in topological order,
backwards in reverse, GPipe or 1F1B interleaving), skipping those that are not its own, and
a receive only waits for a value produced by an earlier event in that order, so by
induction no rank waits forever on a live peer. (Gloo matches messages by tag; NCCL, which
matches in posting order, is not supported by this module.)

Messages are matched by tag: each transfer of a step has an index in the step's message
table (identical on every rank); its header, data and gradient use tags 4i, 4i+1, 4i+2.
A data message is preceded by a small header (dtype, shape) so the receiver can allocate.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from heterog.errors import RankError

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16)
MAX_DIMS = 8


def wait_for(work: dist.Work, *, rank: int, peer: int, timeout: timedelta, what: str) -> None:
    """Wait for a point-to-point operation; a timeout or a dead peer becomes a RankError that
    names both ranks."""
    try:
        work.wait(timeout)
    except RuntimeError as e:
        raise RankError(rank, f"{what} with rank {peer} did not complete within "
                              f"{timeout.total_seconds():.0f} s ({str(e).splitlines()[0]}); "
                              f"rank {peer} may have died or hung.") from None


class P2P:
    """This rank's side of the step's transfers; counts bytes and waiting time."""

    def __init__(self, rank: int, timeout_s: float, device: torch.device | None = None):
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.timeout = timedelta(seconds=timeout_s)
        # sends not yet waited for, by the key they were made with (None: none given)
        self._pending: dict[Any, list[tuple[dist.Work, torch.Tensor, int]]] = {}
        self.sent_bytes = 0
        self.recv_wait_s = 0.0

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        wait_for(work, rank=self.rank, peer=peer, timeout=self.timeout, what=what)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, key: Any = None) -> None:
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst, tag=tag)
        self._pending.setdefault(key, []).append((work, t, dst))  # keep the buffer alive until it is sent
        self.sent_bytes += t.numel() * t.element_size()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        import time
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        t0 = time.perf_counter()
        self._wait(dist.irecv(buf, src, tag=tag), src, f"receive (tag {tag})")
        self.recv_wait_s += time.perf_counter() - t0
        return buf

    def send_with_header(self, tensor: torch.Tensor, dst: int, tag: int, key: Any = None) -> None:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
            raise RankError(self.rank, f"cannot send a {tensor.dim()}-d {tensor.dtype} tensor between "
                                       f"groups (at most {MAX_DIMS} dims of {len(_DTYPES)} dtypes).")
        values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        header = torch.tensor(values + [0] * (2 + MAX_DIMS - len(values)), dtype=torch.int64, device=self.device)
        self.isend(header, dst, tag, key)
        self.isend(tensor, dst, tag + 1, key)

    def recv_with_header(self, src: int, tag: int) -> torch.Tensor:
        header = self.recv((2 + MAX_DIMS,), torch.int64, src, tag).tolist()
        dtype = _DTYPES[header[0]]
        shape = tuple(header[2:2 + header[1]])
        return self.recv(shape, dtype, src, tag + 1)

    def release(self, key: Any) -> None:
        """Wait for the sends made with `key`, which the caller knows have arrived (gloo calls
        a send complete only once waited for), and let go of their buffers."""
        for work, _, dst in self._pending.pop(key, ()):
            self._wait(work, dst, "send")

    def in_flight(self) -> list[torch.Tensor]:
        """The buffers of sends not yet waited for (live memory)."""
        return [t for sends in self._pending.values() for _, t, _ in sends]

    def wait_all(self) -> None:
        """Wait for every send of the step (the receivers have posted theirs by now)."""
        pending, self._pending = self._pending, {}
        for sends in pending.values():
            for work, _, dst in sends:
                self._wait(work, dst, "send")
