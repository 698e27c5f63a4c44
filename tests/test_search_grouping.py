"""Grouping: contiguous, DAG-respecting, balanced segments of at most K groups."""

import random

from heterog.search.grouping import contiguous_groups, crossing_bytes, group_graph, make_groups
from heterog.search.synthetic import TableCostModel, layered_graph, random_cluster, random_graph


def _acyclic(n, edges):
    indeg = {i: 0 for i in range(n)}
    succ = {i: [] for i in range(n)}
    for a, b in edges:
        indeg[b] += 1
        succ[a].append(b)
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        x = ready.pop()
        seen += 1
        for y in succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    return seen == n


def test_groups_respect_the_dag_on_random_graphs():
    rng = random.Random(1)
    for _ in range(10):
        g = random_graph(rng)
        c = random_cluster(rng)
        costs = TableCostModel(graph=g, cluster=c)
        k = rng.randint(2, 20)
        groups = make_groups(g, c, costs, k)
        assert 1 <= len(groups) <= k
        flat = [n for grp in groups for n in grp]
        assert flat == [n.name for n in g.nodes]  # every node once, in graph order
        edges = group_graph(g, groups)
        assert all(a < b for a, b in edges)  # every inter-group edge points forward
        assert _acyclic(len(groups), edges)


def test_heavy_node_is_its_own_group_and_segments_balance():
    layers = [(1.0, 1, 1.0)] * 30
    layers[15] = (40.0, 1, 1.0)  # as heavy as the rest together
    g = layered_graph(layers)
    weights = [layer[0] for layer in layers]
    groups = contiguous_groups(g, weights, 6)
    assert ("layer15",) in groups
    sizes = [sum(weights[int(n[5:])] for n in grp) for grp in groups]
    light = [s for grp, s in zip(groups, sizes) if grp != ("layer15",)]
    assert max(light) <= 3 * (sum(light) / len(light))


def test_cut_prefers_few_crossing_bytes():
    # activations shrink at layer 10: a cut there is cheap
    layers = [(1.0, 1, 10.0)] * 10 + [(1.0, 1, 0.1)] + [(1.0, 1, 10.0)] * 9
    g = layered_graph(layers)
    cross = crossing_bytes(g)
    groups = contiguous_groups(g, [1.0] * 20, 2)
    cut = len(groups[0])
    assert cross[cut] == min(cross[8:13])
