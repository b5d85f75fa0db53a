"""Test-wide setup: every test run gets its own compile-cache folder (never the user's); tests that
check what only one backend does say so (``needs_backend``, below)."""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any

import pytest

# A fresh compile cache for each test process: pytest itself and, under pytest-xdist (README's
# ``pytest -q`` runs ``-n auto``), each of its workers.  Workers inherit the controller's
# environment, so a folder this file made (marked by KILN_TEST_OWN_CACHE) is replaced by the
# worker's own; a KILN_CACHE_DIR the user gave is kept.
if "KILN_CACHE_DIR" not in os.environ or (
    os.environ.get("KILN_TEST_OWN_CACHE") == "1" and "PYTEST_XDIST_WORKER" in os.environ
):
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-test-cache-")
    os.environ["KILN_TEST_OWN_CACHE"] = "1"
# The suite runs several processes per core (xdist workers, the OpInfo pool, the jobs and programs
# tests start), each with an OpenMP thread per core.  OpenMP's default busy-waiting then burns the
# cores another process is waiting for: a 20-step training job beside two busy 2-thread processes
# took 42-47 s with it, 21 s with passive waits.  Waiting is not arithmetic: results are the same.
# Set here, before torch is imported, so this process and every process it starts get it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The native graph launcher depends only on its source, torch and the compiler (its file name
# says which): one build serves every test run and every process the tests start.
os.environ.setdefault(
    "KILN_LAUNCHER_DIR", os.path.join(tempfile.gettempdir(), f"kiln-test-launcher-{os.getuid()}")
)


# A test of something only one backend does (the C++ backend's generated source, its g++ kernel
# cache, its native launcher, its fusion and memory plan) declares it, with why:
#     @pytest.mark.needs_backend("cpp", reason="checks the generated C++ source")
# and is skipped, saying so, when KILN_BACKEND selects another backend.  Everything else runs on
# the configured backend (KILN_BACKEND=interpreter runs the suite through the reference interpreter).
def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_backend(name, reason): checks what only backend `name` does; skipped under another",
    )


def pytest_report_header(config) -> str:
    from kiln.config import config as kiln_config

    return f"kiln backend: {kiln_config.backend}"


def pytest_runtest_setup(item) -> None:
    import pytest

    from kiln.config import config as kiln_config

    for mark in item.iter_markers("needs_backend"):
        (name,) = mark.args
        reason = mark.kwargs.get("reason")
        if not reason:
            raise pytest.UsageError(f"{item.nodeid}: needs_backend({name!r}) without a reason")
        if kiln_config.backend != name:
            pytest.skip(f"needs the {name} backend ({reason}); KILN_BACKEND={kiln_config.backend}")


# README's ``pytest -q`` runs the tests in parallel (pytest-xdist; addopts in pyproject.toml:
# ``-n auto --dist loadgroup``; ``-n 0`` runs them in this process).  ``auto``: one worker per
# usable CPU, at most MAX_WORKERS (tests start their own processes and compile with g++, and each
# worker holds its own torch, Dynamo and compile cache in memory).
MAX_WORKERS = 8

# Files whose tests run in one worker, by group name; every other test is scheduled on its own.
# A file belongs here when its tests share something built once per process: a module- or
# session-scoped fixture of this suite (checked at collection: _check_groups) or module state.
GROUPS = {
    # module fixture: the sweep's worker pool, fed the ops of every collected OpInfo test
    "tests/conformance/test_opinfo.py": "opinfo",
    # module state: the summary test reads the STATS the fuzz test fills
    "tests/fuzz/test_fuzz.py": "fuzz",
    "tests/bench/test_bench_smoke.py": "bench_smoke",  # one bench/run.py run (module fixture)
    "tests/bench/test_tensor_memory.py": "tensor_memory",  # one counting-allocator run
    "tests/cluster/test_postgres.py": "postgres",  # one PostgreSQL server when none is given
    "tests/kernels/test_layer_norm_zero_variance.py": "layer_norm_zero_variance",
    # the session fixture ``reference`` (tests/distributed/conftest.py): one single-process run
    "tests/distributed/test_data_parallel.py": "distributed_reference",
    "tests/distributed/test_cluster_job.py": "distributed_reference",
    "tests/distributed/test_unused_parameters.py": "distributed_unused",  # one 2-worker run
}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def _group_of(nodeid: str) -> str | None:
    return GROUPS.get(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups of GROUPS.  (xdist's own loadgroup reads
    ``xdist_group`` marks through a node-id suffix that pytest 9.2's node ids no longer take: its
    groups were silently split.)  Groups are scheduled first, largest first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid) or nodeid

    return FileGroupScheduling(config, log)


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The module-, package- and session-scoped fixtures of this suite that ``item`` requests
    (directly, or through the fixtures it requests; autouse fixtures excluded, they are cheap
    settings every test of a folder gets): the expensive setups it shares with other tests."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a Python test function
        return []
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    shared: set[str] = set()
    todo, seen = list(info.argnames), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        defs = info.name2fixturedefs.get(name, ())
        if not defs:
            continue
        fdef = defs[-1]
        todo.extend(fdef.argnames)
        path = os.path.abspath(inspect.getsourcefile(fdef.func) or "")
        if fdef.scope != "function" and path.startswith(root):
            shared.add(f"{os.path.relpath(path, root)}::{name}")
    return sorted(shared)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that requests a shared fixture is in GROUPS, in the group of every other test
    that requests it: otherwise two workers would each build it (or a fixture that must see all
    its tests, like the OpInfo pool, would see some)."""
    groups: dict[str, set[str | None]] = {}
    for item in items:
        for key in _shared_fixtures(item):
            groups.setdefault(key, set()).add(_group_of(item.nodeid))
    for key, got in groups.items():
        if len(got) != 1 or None in got:
            raise pytest.UsageError(
                f"tests sharing the fixture {key} are not in one group of GROUPS in "
                f"tests/conftest.py (groups: {sorted(map(str, got))}): add their files to one group"
            )


# A test's ``record_property("summary", text)`` is printed at the end of the run (tests/fuzz reports
# its program counts so): the reports come back from xdist workers, whose own output is not shown.
_SUMMARIES: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SUMMARIES.extend(str(v) for k, v in report.user_properties if k == "summary")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in dict.fromkeys(_SUMMARIES):  # each once (every phase's report carries them)
        terminalreporter.write_line(line)
