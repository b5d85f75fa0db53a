"""Issue 15 finding 7: a damaged store refuses to start (naming the file and the recovery),
a full disk leaves the store consistent and StopTask still stops the processes; file modes."""

from __future__ import annotations

import os
import sqlite3

import pytest
from click.testing import CliRunner
from cluster_testlib import PY, add_instance, container, kill_task_processes, register, wait_for

from kiln.cluster.agent import Agent
from kiln.cluster.cli import cluster as cluster_cli
from kiln.cluster.errors import ServerException
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store, StoreDamaged


def _populated(path: str) -> None:
    svc = ClusterService(Store(path))
    for i in range(60):
        svc.create_cluster({"clusterName": f"c{i}"})
    svc.store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def test_damaged_store_refuses_to_start_with_recovery_command(tmp_path):
    db = str(tmp_path / "c.db")
    _populated(db)
    size = os.path.getsize(db)
    with open(db, "r+b") as f:  # scribble over every page after the first
        f.seek(4096)
        f.write(b"\xff" * (size - 4096))
    with pytest.raises(StoreDamaged) as caught:
        Store(db)
    assert db in str(caught.value) and ".recover" in str(caught.value)
    out = CliRunner().invoke(cluster_cli, ["--store", db, "list-tasks"])
    assert out.exit_code == 1 and ".recover" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("content", [b"", b"this is not a database at all" * 10])
def test_empty_or_foreign_file_is_not_silently_started(tmp_path, content):
    db = tmp_path / "c.db"
    db.write_bytes(content)
    with pytest.raises(StoreDamaged, match="refusing to start"):
        Store(str(db))
    assert db.read_bytes() == content  # left as it was


def test_new_store_is_private(tmp_path):
    db = tmp_path / "sub" / "c.db"
    Store(str(db)).query("SELECT COUNT(*) AS n FROM tasks")
    assert os.stat(db).st_mode & 0o077 == 0
    assert os.stat(db.parent).st_mode & 0o077 == 0


def test_disk_full_keeps_store_consistent_and_stop_still_stops(tmp_path, monkeypatch):
    svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    svc.create_cluster({})
    agent = Agent(svc, str(tmp_path / "agent"), poll_interval=0.05)
    agent.start()
    try:
        add_instance(svc, "trn1.2xlarge")
        register(svc, "sleepy", container(command=[PY, "-c", "import time; time.sleep(120)"]))
        arn = svc.run_task({"taskDefinition": "sleepy"})["tasks"][0]["taskArn"]
        wait_for(lambda: svc.store.query("SELECT pid FROM tasks")[0]["pid"])
        pid = svc.store.query("SELECT pid FROM tasks")[0]["pid"]
        real = Store.transaction

        def full(self, exclusive=False):
            if exclusive:
                raise sqlite3.OperationalError("database or disk is full")
            return real(self, exclusive)

        monkeypatch.setattr(Store, "transaction", full)
        with pytest.raises(ServerException, match="full"):
            svc.stop_task({"task": arn})
        with pytest.raises(sqlite3.OperationalError):
            svc.run_task({"taskDefinition": "sleepy"})
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), timeout=20)
        monkeypatch.setattr(Store, "transaction", real)  # space is back: the stop is recorded
        t = wait_for(
            lambda: (
                (d := svc.describe_tasks({"tasks": [arn]})["tasks"][0])["lastStatus"] == "STOPPED"
                and d
            )
        )
        assert t["stopCode"] == "UserInitiated"
        assert len(svc.list_tasks({"desiredStatus": "STOPPED"})["taskArns"]) == 1
    finally:
        agent.stop()
        kill_task_processes(svc.store)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_orphans_of_a_task_the_store_forgot_are_killed(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    svc.create_cluster({})
    add_instance(svc, "trn1.2xlarge")
    register(svc, "sleepy", container(command=[PY, "-c", "import time; time.sleep(120)"]))
    arn = svc.run_task({"taskDefinition": "sleepy"})["tasks"][0]["taskArn"]
    agent = Agent(svc, str(tmp_path / "agent"))
    agent.step()
    pid = svc.store.query("SELECT pid FROM tasks")[0]["pid"]
    with svc.store.transaction(exclusive=True) as tx:  # the store lost the task
        tx.execute("DELETE FROM tasks WHERE arn = ?", (arn,))
        tx.execute("UPDATE devices SET task_arn = NULL")
    fresh = Agent(svc, str(tmp_path / "agent"))
    assert fresh.sweep_orphans() >= 1
    wait_for(lambda: _zombie(pid), timeout=10)
