"""Cutting a model into the stages of a plan: a stage of its own, below both the search and the
executor, because the planner must obey what the executor can cut.

`split_export.py` exports the model to one aten graph (torch.export, non-strict) and lists
what constrains a cut (`cut_constraints`: a batch statistic's producer and consumer share a
group, data-free nodes run with their consumers), which the search applies when it forms
groups (search/constraints.py); `assign.py` gives every graph node its group;
`rewrite.py` keeps every cut runnable (data-free values recomputed per stage, tensors made
batch-first across a cut); `partition.py` splits the graph into the dataflow the executor runs
(`dataflow.py`: stages, the values between them, the parameters each group holds);
`loss_stage.py` puts the loss where the plan computes it.
"""
