"""The deadlock check of a Program (program.validate): the program run abstractly, as the
executor runs it, must bring every device to its end."""

from __future__ import annotations

from collections import defaultdict

from heterog.errors import PlanError
from heterog.lower.program import Collective, Compute, Instruction, Optimizer, Program, Recv, Send


class _Lanes:
    """Each device's lane (execute/sync.py): the collectives it launched, run one after another
    in launch order; one completes once it heads the lane of every member."""

    def __init__(self, devices: tuple[str, ...], everyone: dict[tuple, set[str]]):
        self.everyone = everyone
        self.launched: dict[str, list[tuple]] = defaultdict(list)
        self.head = dict.fromkeys(devices, 0)  # the first collective not yet completed
        self.done: set[tuple] = set()

    def drained(self, d: str) -> bool:
        return self.head[d] == len(self.launched[d])

    def _heads(self, c: tuple, e: str) -> bool:
        return self.head[e] < len(self.launched[e]) and self.launched[e][self.head[e]] == c

    def run(self) -> bool:
        """Complete what can complete; whether anything did."""
        moved = False
        for d in self.head:
            while not self.drained(d):
                c = self.launched[d][self.head[d]]
                if not all(self._heads(c, e) for e in self.everyone[c]):
                    break
                self.done.add(c)
                for e in self.everyone[c]:
                    self.head[e] += 1
                moved = True
        return moved


def check_deadlock(prog: Program, source: str) -> None:
    """Run the program abstractly, as the executor does: sends never block, a receive waits
    for its send, and a collective is launched without waiting onto its device's lane
    (`_Lanes`). A compute waits for the gather that serves it (a stage-3 sharded block's
    parameters); the optimizer step, like the end of the step, waits until every collective
    its device launched has completed. Every device must reach its end."""
    pos = {d: 0 for d in prog.devices}
    posted: set[int] = set()
    lanes = _Lanes(
        prog.devices,
        {
            i.ident: set(i.members) | ({i.server} if i.server else set())
            for lst in prog.instructions.values()
            for i in lst
            if isinstance(i, Collective)
        },
    )
    gather_for = {
        (d, i.serves): i.ident
        for d, lst in prog.instructions.items()
        for i in lst
        if isinstance(i, Collective) and i.serves is not None
    }
    lists = prog.instructions

    def blocked(d: str, i: Instruction) -> bool:
        if isinstance(i, Recv):
            return i.tag not in posted
        if isinstance(i, Optimizer):
            return not lanes.drained(d)
        if isinstance(i, Compute):
            wanted = gather_for.get((d, (i.block, i.phase, i.microbatch)))
            return wanted is not None and wanted not in lanes.done
        return False

    progress = True
    while progress:
        progress = lanes.run()
        for d in prog.devices:
            lst = lists[d]
            while pos[d] < len(lst) and not blocked(d, lst[pos[d]]):
                i = lst[pos[d]]
                if isinstance(i, Collective):
                    lanes.launched[d].append(i.ident)
                    lanes.run()
                elif isinstance(i, Send):
                    posted.add(i.tag)
                pos[d] += 1
                progress = True
    stuck = {
        d: lists[d][p] if p < len(lists[d]) else None
        for d, p in pos.items()
        if p < len(lists[d]) or not lanes.drained(d)
    }
    if stuck:
        what = "; ".join(
            f"{d!r} waits at instruction {pos[d]} ({_describe(i)})"
            if i is not None
            else f"{d!r} waits at its end for its collectives"
            for d, i in list(stuck.items())[:4]
        )
        raise PlanError(
            f"{source}: the program deadlocks: {what}. Each waits on a peer that waits "
            f"on it; re-create the program with `heterog lower` (its order cannot deadlock)."
        )


def _describe(i: Instruction) -> str:
    if isinstance(i, Recv):
        return f"receive tag {i.tag} from {i.peer!r}"
    if isinstance(i, Collective):
        return f"{i.method} collective of {i.describe()} with {list(i.members)}"
    if isinstance(i, Optimizer):
        return "optimizer step, waiting for the collectives this device launched"
    if isinstance(i, Compute):
        return f"{i.phase} of block {i.block}, micro-batch {i.microbatch}, waiting for its parameters"
    return str(i.kind)
