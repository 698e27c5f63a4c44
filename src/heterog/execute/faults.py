"""Fault injection for the robustness tests (ir/run_request.py Fault): a rank that dies or
hangs at a given step — at its start, or between backward and the gradient sync while its
peers wait for it — or whose gradients overflow (fp16)."""

from __future__ import annotations

import os
import time

from torch import nn

from heterog.ir.run_request import Fault, FaultKind, FaultPhase

EXIT_CODE = 17  # what a rank that was made to die exits with (the launcher names it)


def inject_fault(
    fault: Fault | None, rank: int, step: int, timeout_s: float, phase: FaultPhase = FaultPhase.START
) -> None:
    """Die, or hang past every timeout, when `fault` hits this rank at this step and phase."""
    if fault is None or not fault.hits(rank, step, phase):
        return
    if fault.kind is FaultKind.DIE:
        os._exit(EXIT_CODE)
    if fault.kind is FaultKind.HANG:
        time.sleep(10 * timeout_s + 3600)


def overflow_gradient(fault: Fault | None, rank: int, step: int, params: list[nn.Parameter]) -> None:
    """Fault kind 'overflow' (fp16): an inf in this rank's first gradient at `step`, after the
    sync, as if its gradients had overflowed."""
    if fault is None or fault.kind is not FaultKind.OVERFLOW or (fault.rank, fault.step) != (rank, step):
        return
    g = next((p.grad for p in params if p.grad is not None), None)
    if g is not None:
        g.view(-1)[0] = float("inf")
