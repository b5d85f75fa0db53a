"""The lazy device's tests run under both of its recorders: every test of a ``test_lazy_*.py``
module runs once with the native recorder (the device's default) and once with the Python one
(the device's recorder where the native one cannot be built, or with
``KILN_LAZY_RECORDER=python``), the test id saying which (``[native]``, ``[python]``).  Other
modules run with the configured recorder; those that need one say so themselves
(``_native_testlib.device_recorder``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _native_testlib import device_recorder

RECORDERS = ("native", "python")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "one_recorder: a test of a lazy-device module that does not depend on the recorder "
        "(compile mode, CPU tensors): run once, with the default",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    lazy_module = Path(metafunc.definition.fspath).name.startswith("test_lazy_")
    if lazy_module and metafunc.definition.get_closest_marker("one_recorder") is None:
        metafunc.parametrize("lazy_recorder", RECORDERS, indirect=True, scope="module")


@pytest.fixture(autouse=True)
def lazy_recorder(request: pytest.FixtureRequest):
    """The kiln device's recorder for this test: the parameter's, where the module is one of the
    lazy device's (above) -- in this process and, through ``KILN_LAZY_RECORDER``, in the
    processes the test starts; otherwise the configured one."""
    name = getattr(request, "param", None)
    if name is None:
        yield None
        return
    before = os.environ.get("KILN_LAZY_RECORDER")
    os.environ["KILN_LAZY_RECORDER"] = name
    try:
        with device_recorder(name):
            yield name
    finally:
        if before is None:
            del os.environ["KILN_LAZY_RECORDER"]
        else:
            os.environ["KILN_LAZY_RECORDER"] = before
