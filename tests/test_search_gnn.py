"""The GNN policy: one set of weights for any cluster size; REINFORCE improves the reward."""

import random

import torch

from heterog.search.estimate import estimate
from heterog.search.gnn.features import build_features
from heterog.search.gnn.model import MICROBATCH_OPTIONS
from heterog.search.gnn.policy import SHIPPED_POLICY, load_policy, new_policy
from heterog.search.gnn.train import TrainConfig, make_problem, mean_reward, synthetic_problems, train
from heterog.search.synthetic import layered_graph, random_graph, toy_cluster


def test_forward_on_two_cluster_sizes_with_one_set_of_weights():
    pol = new_policy(seed=0)
    g = random_graph(random.Random(0))
    small = make_problem(g, toy_cluster([10.0, 20.0], devices_per_node=2))
    large = make_problem(g, toy_cluster([10.0, 20.0, 30.0] * 4, devices_per_node=4))
    for prob in (small, large):
        f = build_features(prob)
        out = pol.net(f)
        n, nodes = prob.n_devices, f.n_nodes
        assert out.placement_logits.shape == (prob.n_groups, 2 + nodes + n)
        assert out.sync_logits.shape == (prob.n_groups, 2)
        assert out.micro_logits.shape == (len(MICROBATCH_OPTIONS),)
        assert torch.isfinite(out.placement_logits[:, 1:]).all()
        for s in pol.propose(prob, samples=4, seed=1):
            assert len(s.placements) == prob.n_groups
            assert all(max(p.devices) < n for p in s.placements)
            assert estimate(prob, s).iteration_time_s > 0


def test_reinforce_improves_reward_on_a_tiny_problem():
    prob = make_problem(
        layered_graph([(1.0, 20, 1.0)] * 6 + [(0.1, 300, 0.01)], batch_size=32),
        toy_cluster([40.0, 10.0, 10.0], devices_per_node=1),
        max_groups=8,
    )
    pol = new_policy(seed=0)
    before = mean_reward(pol, prob, samples=32, seed=5)
    train(pol, [prob], TrainConfig(steps=40, samples_per_step=8, seed=0))
    after = mean_reward(pol, prob, samples=32, seed=5)
    assert after > before + 0.05, (before, after)


def test_policy_save_load_round_trip(tmp_path):
    pol = new_policy(seed=3)
    path = tmp_path / "p.pt"
    pol.save(path)
    again = load_policy(path)
    prob = synthetic_problems(1, seed=2, max_devices=4)[0]
    f = build_features(prob)
    torch.testing.assert_close(pol.net.eval()(f).placement_logits, again.net(f).placement_logits)


def test_shipped_policy_is_small_and_loads():
    assert SHIPPED_POLICY.exists(), "the pre-trained policy ships with the package"
    assert SHIPPED_POLICY.stat().st_size < 5 * 2**20
    pol = load_policy(None)
    prob = synthetic_problems(1, seed=11, max_devices=8)[0]
    assert pol.propose(prob, samples=2)


def test_planner_uses_and_fine_tunes_a_policy_without_touching_it():
    from heterog.search.objective import Goal
    from heterog.search.planner import plan_graph

    prob = synthetic_problems(1, seed=4, max_devices=4)[0]
    pol = new_policy(seed=1)
    before = {k: v.clone() for k, v in pol.net.state_dict().items()}
    # the GNN lane runs its 100 moves, however slow the machine, within the budget's safety stop
    r = plan_graph(  # tolerance 0: the fastest candidate (a tolerance may prefer a simpler one)
        prob.graph,
        prob.cluster,
        prob.costs,
        budget_s=60,
        policy=pol,
        finetune_s=0.5,
        max_iters=100,
        goal=Goal(tolerance=0),
    )
    names = {c.strategy for c in r.candidates}
    assert {"gnn", "gnn+search"} <= names
    gnn = next(c for c in r.candidates if c.strategy == "gnn")
    assert r.best.predicted_iteration_time_s <= gnn.iteration_time_s or not gnn.feasible
    for k, v in pol.net.state_dict().items():
        assert torch.equal(v, before[k]), "fine-tuning must work on a copy"
