"""Every cluster test ends with the store invariants checked on each store it opened."""

from __future__ import annotations

import os

import pytest
from cluster_testlib import check_invariants

from kiln.cluster.store import Store, StoreDamaged


@pytest.fixture(autouse=True)
def _store_invariants_after_each_test(monkeypatch):
    opened: list[Store] = []
    original = Store.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(Store, "__init__", tracking_init)
    yield
    seen: set[str] = set()
    for store in opened:
        if store.postgres or store.url in seen or not os.path.exists(store.path):
            continue  # PostgreSQL: test_postgres.py checks before dropping its schema
        seen.add(store.url)
        try:
            reopened = Store(store.url)
        except StoreDamaged:
            continue  # a test damaged it on purpose (test_store_safety.py)
        check_invariants(reopened)
