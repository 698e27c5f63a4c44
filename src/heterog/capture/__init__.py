"""capture: nn.Module + example batch → OpGraph (one training iteration, on fake tensors),
and the model zoo (heterog.capture.zoo).

- capture(model, example_inputs, *, loss_fn=None, name="model", targets=None, seq_len=None)
- capture_model(name, model_args=None, *, batch_size, seq_len=None)  (zoo name or file.py:factory)
- capture_cached(...): capture_model through the on-disk graph cache (capture/cache.py)
- is_leaf_module(module): the placement-unit rule shared with the executor's fx tracer

The names load on first use, so that reading a cached graph does not import torch.
"""

import importlib as _importlib
import sys as _sys

from heterog._callable import CallablePackage as _CallablePackage

_WHERE = {
    "capture": "heterog.capture.capture",
    "capture_model": "heterog.capture.capture",
    "count_parameters": "heterog.capture.capture",
    "capture_cached": "heterog.capture.cache",
    "is_leaf_module": "heterog.capture.recorder",
}
__all__ = sorted(_WHERE)
_FUNCTIONS = frozenset(_WHERE)  # never shadowed by the submodule capture/capture.py


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(_importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'heterog.capture' has no attribute {name!r}")


# heterog.capture(...) is capture(...) even after the package is imported (see heterog/_callable.py)
_sys.modules[__name__].__class__ = _CallablePackage
