"""The same store, service and agent on a real PostgreSQL server.

Uses ``$KILN_TEST_PG_DSN`` (``.ci/run`` sets it via ``eval "$(bash .ci/postgres.sh)"``); when it
is unset, tries ``.ci/postgres.sh`` itself (without installing anything) and stops that server
afterwards; skips with the reason when no server can start.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.parse
import uuid

import pytest
from cluster_testlib import (
    PY,
    add_instance,
    check_invariants,
    kill_task_processes,
    neuron_all,
    register,
    wait_for,
)
from test_service import FAMILIES, _setup, race  # noqa: F401 - the same property workload

from kiln.cluster.agent import Agent
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", ".ci", "postgres.sh")


@pytest.fixture(scope="module")
def pg_dsn():
    dsn = os.environ.get("KILN_TEST_PG_DSN")
    started_dir = None
    if not dsn:
        env = dict(os.environ, PG_NO_INSTALL="1")
        out = subprocess.run(
            ["bash", SCRIPT], capture_output=True, text=True, timeout=120, env=env, check=False
        )
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in out.stdout.splitlines()
            if line.startswith("export ")
        )
        dsn = exports.get("KILN_TEST_PG_DSN")
        started_dir = exports.get("KILN_TEST_PG_DIR")
        if not dsn:
            reason = (out.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"SKIP PostgreSQL tests: no server could start ({reason})")
            pytest.skip(f"no PostgreSQL server: KILN_TEST_PG_DSN unset and {reason}")
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as e:
        print(f"SKIP PostgreSQL tests: cannot connect to {dsn}: {e}")
        pytest.skip(f"cannot connect to PostgreSQL at {dsn}: {e}")
    yield dsn
    if started_dir:
        subprocess.run(
            ["bash", SCRIPT, "stop", started_dir], capture_output=True, timeout=60, check=False
        )


@pytest.fixture
def pg_url(pg_dsn):
    """A DSN whose search_path is a fresh schema (dropped afterwards)."""
    schema = "kiln_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in pg_dsn else "?"
    url = pg_dsn + sep + "options=" + urllib.parse.quote(f"-csearch_path={schema}")
    yield url
    try:
        check_invariants(Store(url))  # before the schema goes (the autouse check skips PostgreSQL)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_postgres_service_round_trip(pg_url):
    svc = ClusterService(Store(pg_url), seed=0)
    assert svc.store.postgres
    svc.create_cluster({})
    inst = add_instance(svc, "trn1.32xlarge")
    register(svc, "train", neuron_all())
    register(svc, "train", neuron_all())
    t = svc.run_task({"taskDefinition": "train:2"})["tasks"][0]
    assert t["containers"][0]["neuronDeviceIds"] == [str(i) for i in range(16)]
    assert svc.run_task({"taskDefinition": "train"})["failures"] == [
        {"arn": inst, "reason": "RESOURCE:NEURON"}
    ]
    svc.stop_task({"task": t["taskArn"]})
    assert check_invariants(svc.store) == {"active": 0, "held": 0}


def test_postgres_agent_runs_task(pg_url, tmp_path):
    svc = ClusterService(Store(pg_url), seed=0)
    svc.create_cluster({})
    add_instance(svc, "trn1.2xlarge")
    register(svc, "p", neuron_all(command=[PY, "-c", "print('on postgres')"]))
    agent = Agent(svc, str(tmp_path / "agent"), poll_interval=0.05)
    agent.start()
    try:
        arn = svc.run_task({"taskDefinition": "p"})["tasks"][0]["taskArn"]
        wait_for(
            lambda: svc.describe_tasks({"tasks": [arn]})["tasks"][0]["lastStatus"] == "STOPPED",
            timeout=20,
        )
        assert svc.describe_tasks({"tasks": [arn]})["tasks"][0]["containers"][0]["exitCode"] == 0
    finally:
        agent.stop()
        kill_task_processes(svc.store)


def test_postgres_concurrent_run_task_never_overlaps(pg_url):
    svc = ClusterService(Store(pg_url), seed=0)
    svc.create_cluster({})
    _setup(svc)
    svc.store.close()
    started = time.monotonic()
    race(pg_url, seed_base=200, n_procs=2, n_threads=4, calls=20)
    check_invariants(svc.store)
    total = svc.store.query("SELECT COUNT(*) AS n FROM tasks")[0]["n"]
    print(f"postgres: 6 callers, {total} tasks, {time.monotonic() - started:.1f}s")
    assert total > 10
