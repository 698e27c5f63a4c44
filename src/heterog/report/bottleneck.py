"""The short explanation of where a plan's iteration time goes: the busiest device, the
slowest link and the tightest memory, read off a SimResult.

Limitation: the SimResult has no dependency chain, so "critical path" here is the device
whose compute queue is idle least; the true critical path can cross devices and links.
"""

from __future__ import annotations

from dataclasses import dataclass

from heterog.fmt import human_bytes, human_time
from heterog.simulate.result import SimResult


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    title: str  # e.g. "busiest device"
    subject: str  # the device or link it is about
    text: str  # one sentence with the figures


def findings(sim: SimResult, used: tuple[str, ...]) -> list[Finding]:
    """At most three findings, each naming one device or link with its figures."""
    T = sim.iteration_time_s
    out: list[Finding] = []
    devs = [d for d in used if d in sim.compute_time_s] or list(sim.compute_time_s)
    if devs and T > 0:
        d = min(devs, key=lambda d: (sim.idle_time_s.get(d, 0.0), d))
        comp, comm = sim.compute_time_s[d], sim.communication_time_s.get(d, 0.0)
        out.append(
            Finding(
                title="busiest device (critical path)",
                subject=d,
                text=(
                    f"{d} computes for {human_time(comp)} of the {human_time(T)} iteration "
                    f"({100 * comp / T:.0f} %) and is idle {human_time(sim.idle_time_s.get(d, 0.0))}; "
                    f"its communication takes {human_time(comm)} (overlapping compute where it can). "
                    f"A shorter iteration needs less work on {d} or less waiting before its last task."
                ),
            )
        )
    if sim.link_busy_time_s and T > 0:
        link, busy = max(sim.link_busy_time_s.items(), key=lambda kv: (kv[1], kv[0]))
        out.append(
            Finding(
                title="slowest link",
                subject=link,
                text=(
                    f"link {link} is busy {human_time(busy)} ({100 * busy / T:.0f} % of the iteration), "
                    f"carrying {human_bytes(sim.link_bytes.get(link, 0.0))}."
                ),
            )
        )
    mems = [d for d in devs if sim.memory_capacity_bytes.get(d)]
    if mems:
        d = max(mems, key=lambda d: (sim.peak_memory_bytes[d] / sim.memory_capacity_bytes[d], d))
        peak, cap = sim.peak_memory_bytes[d], sim.memory_capacity_bytes[d]
        verdict = (
            "it does not fit"
            if peak > cap
            else "a larger share or batch would not fit"
            if peak > 0.9 * cap
            else "there is room"
        )
        out.append(
            Finding(
                title="tightest memory",
                subject=d,
                text=(f"{d} peaks at {human_bytes(peak)} of {human_bytes(cap)} ({100 * peak / cap:.0f} %): {verdict}."),
            )
        )
    return out
