"""Training the GNN policy: REINFORCE against the iteration-time estimate, with self-imitation.

Per step: one problem, K sampled strategies; reward r = −sqrt(score / reference), where score
is the estimated iteration time (inflated when memory overflows, estimate.py) and reference
is the best baseline's, so rewards of different problems are comparable (HeteroG used
−sqrt(time in ms)). Advantage = r − b with b a per-problem moving average (Williams 1992).
Loss = −mean(advantage · log π(a)) − β · entropy; β grows when the best reward stalls, as
HeteroG raised its entropy bonus. Every few steps the policy imitates the best distinct
strategies kept in a per-problem replay pool, weighted by how much they beat the baseline
(self-imitation learning, Oh et al. 2018). Problems are synthetic (synthetic.py): random
layered graphs on random 2–8 device clusters, so training takes minutes, not hours.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from heterog.capture import capture_model
from heterog.cost import build_cost_model
from heterog.errors import ModelError
from heterog.hardware.spec import load_cluster
from heterog.search.baselines import BASELINE_BUILDERS
from heterog.search.estimate import estimate
from heterog.search.gnn.features import Features, build_features
from heterog.search.gnn.policy import Actions, Policy, decode, entropy, log_prob, sample_actions
from heterog.search.grouping import make_groups
from heterog.search.problem import Problem
from heterog.search.synthetic import TableCostModel, random_cluster, random_graph


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 400
    samples_per_step: int = 8
    lr: float = 3e-3
    entropy_weight: float = 0.01
    baseline_decay: float = 0.9
    pool_size: int = 8
    imitate_every: int = 4
    max_groups: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.samples_per_step < 2:
            raise ValueError("steps must be ≥ 1 and samples_per_step ≥ 2 (the baseline needs a spread).")


@dataclass(kw_only=True)
class _Task:
    prob: Problem
    feats: Features
    reference_s: float
    baseline: float = 0.0
    seen: int = 0
    pool: list[tuple[float, Actions]] = field(default_factory=list)
    best_reward: float = -math.inf


def make_problem(graph, cluster, max_groups: int = 16) -> Problem:
    costs = TableCostModel(graph=graph, cluster=cluster)
    return Problem(
        graph=graph,
        cluster=cluster,
        costs=costs,
        groups=make_groups(graph, cluster, costs, max_groups),
        batch_size=graph.batch_size,
    )


def synthetic_problems(count: int, *, seed: int = 0, max_devices: int = 8, max_groups: int = 16) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        g = random_graph(rng, batch_size=rng.choice([16, 32, 64, 128]))
        out.append(make_problem(g, random_cluster(rng, max_devices=max_devices), max_groups))
    return out


# Zoo models for training, none of them among the paper's eight that benchmarks/plan_quality.py
# evaluates: "name:batch[:seq_len]"
DEFAULT_ZOO = ("resnet50:64", "vit_b_16:32", "gpt2:16:256", "toy-cnn:64", "mlp:128")
DEFAULT_CLUSTERS = ("paper-8gpu", "mixed-16")


def zoo_problems(models: Sequence[str], clusters: Sequence[str], *, max_groups: int = 16) -> list[Problem]:
    """Real training problems: captured zoo models, the analytic cost model, built-in clusters."""
    out = []
    for spec in models:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts[1:]):
            raise ModelError(f"training model {spec!r}: write name:batch or name:batch:seq_len, e.g. gpt2:16:256.")
        seq = int(parts[2]) if len(parts) == 3 else None
        graph = capture_model(parts[0], None, batch_size=int(parts[1]), seq_len=seq)
        for name in clusters:
            cluster = load_cluster(name)
            costs = build_cost_model(graph, cluster)
            out.append(
                Problem(
                    graph=graph,
                    cluster=cluster,
                    costs=costs,
                    groups=make_groups(graph, cluster, costs, max_groups),
                    batch_size=graph.batch_size,
                )
            )
    return out


def _task(prob: Problem) -> _Task:
    ref = min(estimate(prob, build(prob)).score for build in BASELINE_BUILDERS.values())
    return _Task(prob=prob, feats=build_features(prob), reference_s=ref)


def reward(task: _Task, a: Actions, out) -> float:
    s = decode(task.prob, task.feats, out, a)
    return -math.sqrt(estimate(task.prob, s).score / task.reference_s)


def mean_reward(policy: Policy, prob: Problem, samples: int = 16, seed: int = 0) -> float:
    """Expected reward of the policy's sampled strategies on one problem (for evaluation)."""
    task = _task(prob)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = policy.net(task.feats)
        return sum(reward(task, sample_actions(out, gen), out) for _ in range(samples)) / samples


def train(
    policy: Policy,
    problems: list[Problem],
    config: TrainConfig = TrainConfig(),
    *,
    budget_s: float | None = None,
    log: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train in place; returns one record per step (problem, mean reward, best reward, loss)."""
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    rng = random.Random(config.seed)
    tasks = [_task(p) for p in problems]
    net = policy.net
    net.train()
    opt = torch.optim.Adam(net.parameters(), lr=config.lr)
    beta = config.entropy_weight
    history: list[dict] = []
    stall = 0
    begin = time.perf_counter()
    for step in range(config.steps):
        if budget_s is not None and time.perf_counter() - begin > budget_s:
            break
        ti = step % len(tasks) if step < len(tasks) else rng.randrange(len(tasks))
        task = tasks[ti]
        out = net(task.feats)
        acts = [sample_actions(out, gen) for _ in range(config.samples_per_step)]
        rewards = [reward(task, a, out) for a in acts]
        mean_r = sum(rewards) / len(rewards)
        if task.seen == 0:
            task.baseline = mean_r
        adv = torch.tensor([r - task.baseline for r in rewards])
        lps = torch.stack([log_prob(out, a) for a in acts])
        loss = -(adv * lps).mean() - beta * entropy(out)
        improved = False
        for r, a in zip(rewards, acts):
            if r > task.best_reward + 1e-9:
                task.best_reward, improved = r, True
            if all(a.key() != p[1].key() for p in task.pool):
                task.pool.append((r, a))
        task.pool.sort(key=lambda p: -p[0])
        del task.pool[config.pool_size :]
        if step % config.imitate_every == 0:
            good = [(r - task.baseline, a) for r, a in task.pool if r > task.baseline]
            if good:
                loss = loss - sum(w * log_prob(out, a) for w, a in good) / len(good)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        task.baseline = config.baseline_decay * task.baseline + (1 - config.baseline_decay) * mean_r
        task.seen += 1
        stall = 0 if improved else stall + 1
        if stall > 3 * len(tasks):  # no problem improved for a while: explore more
            beta, stall = min(beta * 1.5, 0.2), 0
        rec = {
            "step": step,
            "problem": ti,
            "mean_reward": mean_r,
            "best_reward": task.best_reward,
            "loss": float(loss.detach()),
            "entropy_weight": beta,
        }
        history.append(rec)
        if log is not None:
            log(rec)
    net.eval()
    policy.meta.update(
        {"trained_steps": len(history), "problems": len(tasks), "train_time_s": round(time.perf_counter() - begin, 1)}
    )
    return history
