"""pytest plugin: load and configure the native lazy recorder before any test runs, to check that
the kiln device behaves the same beside it (docs/native_recorder.md, "Checked"):

    PYTHONPATH=tests/frontends python -m pytest -q -n 0 -p _native_loaded tests/frontends/test_lazy_*.py
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    from kiln.frontends.lazy import native

    native.load()  # raises NativeUnavailable (with the reason) where it cannot be built


def pytest_report_header(config: pytest.Config) -> str:
    from kiln.frontends.lazy import native

    return f"native lazy recorder loaded and configured: {native.load().__name__}"
