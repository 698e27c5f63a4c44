"""Fixtures every module may use. The suite runs serially (`make test`): the tests that start
local runs — rank processes over gloo, shaped links in network namespaces, launchers that
are signalled or killed — share machine-wide state (namespaces, the cleanup of dead
launchers' leftovers, rendezvous ports, wall-time bounds) and must not overlap, and on two
cores parallel workers measured no faster."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def plan_batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The module's `@pytest.mark.batched` plans, run in one launch (tests/plan_batch.py)."""
    from plan_batch import module_batch

    return module_batch(request, tmp_path_factory.mktemp(request.path.stem))
