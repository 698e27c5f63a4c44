"""HeteroG's learned policy, rebuilt: a graph-attention network over the grouped op graph with
device-aware features, trained by REINFORCE with self-imitation (see train.py)."""
