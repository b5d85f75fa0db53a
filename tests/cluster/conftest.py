"""Every cluster test ends with the store invariants checked on each store it opened; the service
fixtures the newer test files share (``svc``: a service with its default cluster; ``served``: the
same with an agent running its tasks)."""

from __future__ import annotations

import os

import pytest
from cluster_testlib import check_invariants, kill_task_processes

from kiln.cluster.agent import Agent
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store, StoreDamaged


@pytest.fixture
def svc(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    return s


@pytest.fixture
def served(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    agent = Agent(s, str(tmp_path / "agent"), poll_interval=0.05)
    agent.start()
    try:
        yield s
    finally:
        agent.stop()
        kill_task_processes(s.store)


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
