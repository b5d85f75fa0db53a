"""Conformance tests compile into a fresh Kiln cache directory, never the user's cache."""

from __future__ import annotations

import pytest

import kiln


@pytest.fixture(scope="session", autouse=True)
def _fresh_kiln_cache(tmp_path_factory: pytest.TempPathFactory):
    old = kiln.config.cache_dir
    kiln.config.update(cache_dir=str(tmp_path_factory.mktemp("kiln_cache")))
    yield
    kiln.config.update(cache_dir=old)
