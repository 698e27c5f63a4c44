"""How the suite shares the machine when it runs on two pytest-xdist workers
(`pytest -n 2 --dist loadscope tests`; `make test` runs serially: on two cores it was no faster).

Tests that start local runs — rank processes over gloo, shaped links in network namespaces,
launchers that are signalled or killed, profiles that time this machine — share
machine-wide state: namespaces (`ip netns` is global; some tests check that none named like
ours appeared or is left), the cleanup of dead launchers' leftovers that every launch does
(execute/stale.py), the rendezvous port a launcher picks seconds before its rank 0 binds it,
and wall-time bounds on failing runs. So they run one after another, as in a serial run:
all RANK_MODULES tests form one unit of work that a single worker runs in file order
(`pytest_xdist_make_scheduler`), while the other worker runs the in-process modules beside
them. Each also holds an exclusive lock on one file per session (`_RunLock`), so that no
scheduling (another `--dist`, more workers) can overlap two of them.

Under xdist, a test outside RANK_MODULES that starts a rank or shaped links in-process fails
at once and says so. Without xdist (`pytest tests/test_x.py`) none of this applies.

(`--dist loadgroup` with `xdist_group` marks would be the usual way, but pytest-xdist 3.8
marks a group by rewriting `item._nodeid`, which pytest 9 no longer reads: the groups are
silently ignored.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

import pytest

# Under xdist, one thread per test process, as the launcher gives every rank
# (OMP_NUM_THREADS=1): a test process's second OpenMP thread only spins against the ranks and
# the other worker (measured under load: 13 % less CPU time, ~20 % less wall time). A serial
# run (`make test`) keeps torch's default: there the second core is otherwise idle.
# Set before anything imports torch; subprocesses (the CLI tests) inherit it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

# Modules most of whose time goes to local runs.
RANK_MODULES = frozenset({
    "test_checkpoint_resume.py",
    "test_cli_tables.py",
    "test_collectives.py",
    "test_demo_scenarios.py",
    "test_every_candidate_runs.py",
    "test_execute_cli.py",
    "test_execute_demo.py",
    "test_execute_emulation.py",
    "test_execute_equivalence.py",
    "test_execute_robustness.py",
    "test_execute_split_models.py",
    "test_gpu.py",
    "test_lower_program.py",
    "test_memory_cap.py",
    "test_profile_calibrate.py",
    "test_profile_links.py",
    "test_run_many.py",
    "test_signals.py",
})


def _is_ranks(item: pytest.Item) -> bool:
    return item.path.name in RANK_MODULES


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Module by module (xdist's loadscope: a module's fixtures are built once), except that
    every RANK_MODULES test is one unit: one worker runs them all, in file order, while the
    other takes the in-process modules. (xdist hands out the largest units first.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RanksTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "ranks" if module.rsplit("/", 1)[-1] in RANK_MODULES else module
    return RanksTogether(config, log)


class _RunLock:
    """This worker's hold on the session's lock file. Holds nest (a module's, then one of its
    tests'); the lock is taken at the first and released after the last. flock locks belong
    to the open file, so a worker keeps one open: a second would wait for the first."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a")
        self._depth = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self._depth == 0:
            fcntl.flock(self._file, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._file, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def _run_lock(tmp_path_factory: pytest.TempPathFactory) -> _RunLock:
    # under xdist every worker's basetemp is a folder of the session's one
    return _RunLock(tmp_path_factory.getbasetemp().parent / "local-runs.lock")


@pytest.fixture(scope="module", autouse=True)
def _module_local_runs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Module-wide, so that module-scoped fixtures that launch runs hold the lock too
    (autouse fixtures are set up first within their scope)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or request.path.name not in RANK_MODULES:
        yield
        return
    with request.getfixturevalue("_run_lock").hold():
        yield


@pytest.fixture(autouse=True)
def _test_local_runs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A `ranks` test holds the lock; any other test that starts a rank or shaped links
    in-process fails and says what to do."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    if _is_ranks(request.node):
        with request.getfixturevalue("_run_lock").hold():
            yield
        return
    from heterog.execute import launcher, netns

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts rank processes or network namespaces but is not a 'ranks' "
                    f"test, so it could overlap another test's local run: add its module to RANK_MODULES in "
                    f"tests/conftest.py", pytrace=False)
    monkeypatch.setattr(launcher, "_start_rank", refuse)
    monkeypatch.setattr(netns.LinkShaping, "_create", refuse)
    yield


@pytest.fixture(scope="module")
def plan_batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The module's `@pytest.mark.batched` plans, run in one launch (tests/plan_batch.py)."""
    from plan_batch import module_batch
    return module_batch(request, tmp_path_factory.mktemp(request.path.stem))
