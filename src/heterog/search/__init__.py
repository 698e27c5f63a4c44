"""Strategy search: from an OpGraph, a Cluster and costs to the best Plan (planner.py).

grouping → problem tables and device tiers → baselines, scored by the simulator → a lower
bound (bound.py) → anytime annealing chains (local_search.py, moves from the registry in
moves.py) from the baselines and from the GNN policy's proposals (gnn/), in two processes
where there are two cores (lanes.py) — all within one deadline.
"""
