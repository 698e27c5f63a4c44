"""Strategy search: from an OpGraph, a Cluster and costs to the best Plan (planner.py).

grouping → problem tables → baselines and the batch-share LP → annealing search scored by a
fast group-level estimate and verified by the simulator → the GNN policy's proposals (gnn/).
"""
