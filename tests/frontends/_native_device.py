"""pytest plugin: run the tests with the native recorder as the kiln device's recorder
(``KILN_LAZY_RECORDER=native``; docs/native_recorder.md, stage 2's gate):

    PYTHONPATH=tests/frontends python -m pytest -q -n 0 -p _native_device \
        tests/frontends/test_lazy_device.py -k "factories_with_device or ..."

The variable is set in this process's environment before Kiln is imported, so processes the
tests start inherit it (those that drop every ``KILN_*`` variable run the default recorder).
"""

from __future__ import annotations

import os

import pytest

os.environ["KILN_LAZY_RECORDER"] = "native"


def pytest_configure(config: pytest.Config) -> None:
    import kiln
    from kiln.frontends.lazy import native

    kiln.config.update(lazy_recorder="native")
    native.load()  # raises NativeUnavailable (with the reason) where it cannot be built


def pytest_report_header(config: pytest.Config) -> str:
    return "kiln device recorder: native (KILN_LAZY_RECORDER=native)"
