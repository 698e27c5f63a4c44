"""lower: Plan → Schedule → Program, every scheduling rule in one place (docs/architecture.md).

`heterog.lower(plan)` — the package called as a function — is the API's lowering of a whole
plan (heterog.orchestrate.lower: inputs, then lowering.lower); the stage's own function is
heterog.lower.lowering.lower(graph, cluster, plan, costs).
"""

import sys as _sys

from heterog._callable import CallablePackage as _CallablePackage

_sys.modules[__name__].__class__ = _CallablePackage
