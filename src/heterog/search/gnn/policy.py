"""The GNN policy as the planner uses it: sample actions, turn them into Strategies, save/load.

The shipped pre-trained weights live next to this module (policy.pt, trained by
`heterog train-policy` on synthetic problems, see train.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from heterog.errors import ArtifactError
from heterog.ir.kinds import SyncMethod
from heterog.ir.plan import split_samples
from heterog.search.gnn.features import Features, build_features
from heterog.search.gnn.model import (
    ALL,
    MICROBATCH_OPTIONS,
    SAME,
    SHARE_PATTERNS,
    PolicyConfig,
    PolicyNet,
    PolicyOutput,
)
from heterog.search.problem import Placement, Problem, Strategy
from heterog.search.shares import balanced_shares

SHIPPED_POLICY = Path(__file__).with_name("policy.pt")
FORMAT = "heterog.GnnPolicy/2"  # 2: share-pattern head


@dataclass(frozen=True, slots=True)
class Actions:
    placement: torch.Tensor  # [G] long
    sync: torch.Tensor  # [G] long
    share: torch.Tensor  # [G] long, index into SHARE_PATTERNS
    micro: torch.Tensor  # [] long

    def key(self) -> tuple:
        return (tuple(self.placement.tolist()), tuple(self.sync.tolist()), tuple(self.share.tolist()), int(self.micro))


def _dists(out: PolicyOutput):
    return tuple(
        torch.distributions.Categorical(logits=t)
        for t in (out.placement_logits, out.sync_logits, out.share_logits, out.micro_logits)
    )


def sample_actions(out: PolicyOutput, generator: torch.Generator | None = None, greedy: bool = False) -> Actions:
    if greedy:
        return Actions(
            out.placement_logits.argmax(dim=1),
            out.sync_logits.argmax(dim=1),
            out.share_logits.argmax(dim=1),
            out.micro_logits.argmax(),
        )
    probs = [
        torch.softmax(t.detach(), dim=-1)
        for t in (out.placement_logits, out.sync_logits, out.share_logits, out.micro_logits)
    ]
    p = torch.multinomial(probs[0], 1, generator=generator).squeeze(1)
    s = torch.multinomial(probs[1], 1, generator=generator).squeeze(1)
    h = torch.multinomial(probs[2], 1, generator=generator).squeeze(1)
    m = torch.multinomial(probs[3], 1, generator=generator).squeeze()
    return Actions(p, s, h, m)


def log_prob(out: PolicyOutput, a: Actions) -> torch.Tensor:
    dp, ds, dh, dm = _dists(out)
    return (
        dp.log_prob(a.placement).sum() + ds.log_prob(a.sync).sum() + dh.log_prob(a.share).sum() + dm.log_prob(a.micro)
    )


def entropy(out: PolicyOutput) -> torch.Tensor:
    dp, ds, dh, dm = _dists(out)
    return dp.entropy().mean() + ds.entropy().mean() + dh.entropy().mean() + dm.entropy()


def pattern_shares(
    prob: Problem, groups: range, devs: tuple[int, ...], pattern: str, microbatches: int
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Shares of a device set by pattern: the LP balance, even, or proportional to the memory
    each device has left after the groups' persistent state (whole samples, by split_samples)."""
    if pattern == "balanced" or len(devs) == 1:
        return balanced_shares(prob, groups, devs, microbatches=microbatches)
    if pattern == "even":
        weights = [1.0] * len(devs)
    else:
        cls = prob.dev_class[list(devs)]
        free = prob.memory_bytes[list(devs)] - prob.persistent_bytes[list(groups)][:, cls].sum(axis=0)
        weights = [max(float(f), 1.0) for f in free]
    mb = prob.batch_size // microbatches
    counts = split_samples(mb, weights)
    keep = [i for i, k in enumerate(counts) if k > 0]
    return tuple(devs[i] for i in keep), tuple(counts[i] / mb for i in keep)


def decode(prob: Problem, f: Features, out: PolicyOutput, a: Actions) -> Strategy:
    """Actions → Strategy; shares of each run of identically placed groups from the share LP."""
    n_nodes = f.n_nodes
    dp_limit = sorted(prob.speed_order[: min(prob.n_devices, prob.batch_size)])
    node_members: list[list[int]] = [[] for _ in range(n_nodes)]
    for d, k in enumerate(f.node_of_device.tolist()):
        node_members[k].append(d)
    scores = out.pair_scores.detach()
    choice: list[tuple[tuple[int, ...], SyncMethod, str]] = []
    for g in range(prob.n_groups):
        act = int(a.placement[g])
        if act == SAME and g > 0:
            choice.append(choice[-1])
            continue
        if act in (SAME, ALL):
            devs = tuple(dp_limit)
        elif act < 2 + n_nodes:
            devs = tuple(node_members[act - 2][: prob.batch_size])
        else:
            devs = (act - 2 - n_nodes,)
        sync = SyncMethod.NONE if len(devs) == 1 else (SyncMethod.PS if int(a.sync[g]) == 1 else SyncMethod.RING)
        choice.append((devs, sync, SHARE_PATTERNS[int(a.share[g])]))
    micro = MICROBATCH_OPTIONS[int(a.micro)]
    if prob.batch_size % micro:
        micro = 1
    placements: list[Placement] = []
    g = 0
    while g < prob.n_groups:
        end = g
        while end + 1 < prob.n_groups and choice[end + 1] == choice[g]:
            end += 1
        members, method, pattern = choice[g]
        used, sh = pattern_shares(prob, range(g, end + 1), members, pattern, micro)
        if len(used) == 1:
            p = Placement(used, sh)
        elif method == SyncMethod.PS:
            server = max(used, key=lambda i: float(scores[g, i]))
            p = Placement(used, sh, SyncMethod.PS, server)
        else:
            p = Placement(used, sh, SyncMethod.RING)
        placements.extend([p] * (end - g + 1))
        g = end + 1
    return Strategy(tuple(placements), micro)


class Policy:
    def __init__(self, net: PolicyNet, meta: dict[str, Any] | None = None):
        self.net = net
        self.meta = meta or {}

    def propose(self, prob: Problem, *, samples: int = 8, seed: int = 0) -> list[Strategy]:
        """The greedy decode plus up to samples−1 sampled ones, distinct."""
        f = build_features(prob)
        with torch.no_grad():
            out = self.net(f)
        gen = torch.Generator().manual_seed(seed)
        seen: set[tuple] = set()
        result: list[Strategy] = []
        for i in range(samples):
            a = sample_actions(out, gen, greedy=(i == 0))
            if a.key() in seen:
                continue
            seen.add(a.key())
            result.append(decode(prob, f, out, a))
        return result

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(
            {
                "format": FORMAT,
                "config": self.net.config.to_dict(),
                "state_dict": self.net.state_dict(),
                "meta": self.meta,
            },
            tmp,
        )
        tmp.replace(path)


def new_policy(config: PolicyConfig | None = None, seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(PolicyNet(config or PolicyConfig()))


def load_policy(source: Any = None) -> Policy | None:
    """None → the shipped file (None if it is missing); a path → that file; a Policy → itself."""
    if isinstance(source, Policy):
        return source
    path = SHIPPED_POLICY if source is None else Path(source)
    if not path.exists():
        if source is None:
            return None
        raise ArtifactError(f"{path}: no such policy file; train one with `heterog train-policy --out {path}`.")
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise ArtifactError(f"{path}: not a readable policy file ({type(e).__name__}: {e}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a heterog GNN policy (expected format {FORMAT}).")
    net = PolicyNet(PolicyConfig(**doc["config"]))
    net.load_state_dict(doc["state_dict"])
    net.eval()
    return Policy(net, doc.get("meta", {}))
