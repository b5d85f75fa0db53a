"""Test-wide setup: every test run gets its own compile-cache folder (never the user's); tests that
check what only one backend does say so (``needs_backend``, below)."""

import os
import tempfile

os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))
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
