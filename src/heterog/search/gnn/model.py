"""The policy network: graph attention over the grouped op graph, device-aware action scores.

Encoder: the group features pass through a linear layer and two GATConv layers (Veličković
et al. 2018; 4 heads) over the group graph, with residuals. Devices get an MLP embedding; the
cluster context is their mean. Every (group, device) pair is scored by an MLP on [group
embedding, device embedding, pair features], so the output width follows the cluster:

  actions of group g = [same placement as g−1, data parallel on all devices,
                        data parallel on node k (one per node), device d alone (one per device)]
  shares of group g  = [balanced by the share LP, even, proportional to free memory]
  sync of group g    = [all-reduce (ring), parameter server on its best-scored device]
  micro-batches      = one of MICROBATCH_OPTIONS, from the pooled graph and cluster context.

With the 'balanced' share pattern the numbers come from the LP (search/shares.py): the policy
decides structure and the optimiser decides numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch_geometric.nn import GATConv

from heterog.search.gnn.features import DEVICE_FEATURES, GROUP_FEATURES, PAIR_FEATURES, Features

MICROBATCH_OPTIONS = (1, 2, 4, 8)
SHARE_PATTERNS = ("balanced", "even", "memory")
SAME, ALL = 0, 1  # fixed action ids; then nodes, then devices


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    hidden: int = 64
    heads: int = 4
    gat_layers: int = 2

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}).")

    def to_dict(self) -> dict:
        return asdict(self)


def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ELU(), nn.Linear(h, o))


@dataclass(frozen=True, slots=True)
class PolicyOutput:
    placement_logits: torch.Tensor  # [G, 2 + n_nodes + n_devices]
    sync_logits: torch.Tensor  # [G, 2]
    share_logits: torch.Tensor  # [G, len(SHARE_PATTERNS)]
    pair_scores: torch.Tensor  # [G, n]: which device of a set should serve as PS
    micro_logits: torch.Tensor  # [len(MICROBATCH_OPTIONS)]


class PolicyNet(nn.Module):
    def __init__(self, config: PolicyConfig = PolicyConfig()):
        super().__init__()
        self.config = config
        h = config.hidden
        self.group_in = nn.Linear(GROUP_FEATURES, h)
        self.gats = nn.ModuleList(
            GATConv(h, h // config.heads, heads=config.heads, add_self_loops=True) for _ in range(config.gat_layers)
        )
        self.device_in = _mlp(DEVICE_FEATURES, h, h)
        self.pair = _mlp(2 * h + PAIR_FEATURES, h, h)
        self.pair_out = nn.Linear(h, 1)
        self.node_out = nn.Linear(h, 1)
        self.all_out = _mlp(2 * h, h, 1)
        self.same_out = _mlp(2 * h, h, 1)
        self.sync_out = _mlp(2 * h, h, 2)
        self.share_out = _mlp(2 * h, h, len(SHARE_PATTERNS))
        self.micro_out = _mlp(2 * h, h, len(MICROBATCH_OPTIONS))

    def forward(self, f: Features) -> PolicyOutput:
        x = torch.nn.functional.elu(self.group_in(f.group))
        for gat in self.gats:
            x = x + torch.nn.functional.elu(gat(x, f.edge_index))
        e = self.device_in(f.device)  # [n, h]
        ctx = e.mean(dim=0, keepdim=True).expand(x.shape[0], -1)  # [G, h]
        G, n = f.pair.shape[:2]
        pair_in = torch.cat([x[:, None, :].expand(G, n, -1), e[None, :, :].expand(G, n, -1), f.pair], dim=2)
        ph = torch.nn.functional.elu(self.pair(pair_in))  # [G, n, h]
        single = self.pair_out(ph).squeeze(-1)  # [G, n]
        # a node's logit reads the mean of its devices' pair embeddings
        counts = torch.bincount(f.node_of_device, minlength=f.n_nodes).clamp(min=1).to(ph.dtype)
        pooled = torch.zeros(G, f.n_nodes, ph.shape[2], dtype=ph.dtype)
        pooled = pooled.index_add(1, f.node_of_device, ph) / counts[None, :, None]
        node = self.node_out(pooled).squeeze(-1)  # [G, n_nodes]
        xc = torch.cat([x, ctx], dim=1)
        prev = torch.cat([x[:1], x[:-1]], dim=0)
        same = self.same_out(torch.cat([x, prev], dim=1))
        same = torch.cat([torch.full_like(same[:1], -1e4), same[1:]], dim=0)  # group 0 has no predecessor
        logits = torch.cat([same, self.all_out(xc), node, single], dim=1)
        micro = self.micro_out(torch.cat([x.mean(dim=0), ctx[0]]))
        return PolicyOutput(
            placement_logits=logits,
            sync_logits=self.sync_out(xc),
            share_logits=self.share_out(xc),
            pair_scores=single,
            micro_logits=micro,
        )
