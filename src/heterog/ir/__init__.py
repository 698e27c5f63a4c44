"""Typed artifacts shared by every stage: OpGraph and Plan."""

from heterog.ir.affine import Affine
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode
from heterog.ir.plan import Group, ModelSpec, Plan, Replica, split_samples

__all__ = ["Affine", "OpEdge", "OpGraph", "OpNode", "Group", "ModelSpec", "Plan", "Replica", "split_samples"]
