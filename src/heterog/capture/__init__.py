"""capture: nn.Module + example batch → OpGraph (one training iteration, on fake tensors),
and the model zoo (heterog.capture.zoo).

- capture(model, example_inputs, *, loss_fn=None, name="model", targets=None, seq_len=None)
- capture_model(name, model_args=None, *, batch_size, seq_len=None)  (zoo name or file.py:factory)
- is_leaf_module(module): the placement-unit rule shared with the executor's fx tracer
"""

from heterog.capture.capture import capture, capture_model, count_parameters
from heterog.capture.recorder import is_leaf_module

__all__ = ["capture", "capture_model", "count_parameters", "is_leaf_module"]

# heterog.capture(...) is capture(...) even after the package is imported (see heterog/_callable.py)
import sys as _sys  # noqa: E402

from heterog._callable import CallablePackage as _CallablePackage  # noqa: E402

_sys.modules[__name__].__class__ = _CallablePackage
