"""A user model file that brings its own training functions (loaded by ranks as
'tests/training_model.py:net'): optimizer(params) with parameter groups by dimension (no
weight decay for 1-D tensors, as nanoGPT configures AdamW), scheduler(optimizer),
evaluate(outputs, targets) and eval_loader(batch_size) over a fixed held-out set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HELD_OUT = 24  # held-out samples: eval_loader's batches of the plan's size


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.act = nn.Tanh()
        self.out = nn.Linear(24, 4)

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


def net():
    return Net()


def example_batch(batch_size):
    return (torch.randn(batch_size, 16),), torch.randint(0, 4, (batch_size,))


def loss(output, targets):
    return F.cross_entropy(output, targets)


def optimizer(params):
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.02, betas=(0.9, 0.95))


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def evaluate(outputs, targets):
    return {"accuracy": (outputs.argmax(-1) == targets).float().mean()}


def eval_loader(batch_size):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(HELD_OUT, 16, generator=g)
    y = torch.randint(0, 4, (HELD_OUT,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, drop_last=True)
