"""Carry out a Program on torch.distributed: the local launcher (launcher.py) starts one worker
per device (worker.py), each interpreting its instructions (runtime.py). Planning, capture and
prediction are the caller's (heterog.orchestrate, heterog.runs)."""
