"""capture: nn.Module + example batch → OpGraph (one training iteration, on fake tensors),
and the model zoo (heterog.capture.zoo)."""

from heterog.capture.capture import capture, capture_model, count_parameters
from heterog.capture.recorder import is_leaf_module

__all__ = ["capture", "capture_model", "count_parameters", "is_leaf_module"]
