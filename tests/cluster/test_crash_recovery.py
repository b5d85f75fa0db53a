"""Kill -9 the server (and its embedded agent) mid-run, restart: nothing leaks, nothing is lost."""

from __future__ import annotations

import os
import signal
import time

import boto3
import psutil
import pytest
from cluster_testlib import (
    PY,
    ServerProcess,
    add_instance,
    check_invariants,
    gpus,
    kill_task_processes,
    neuron_all,
    register,
    wait_for,
)

from kiln.cluster.agent import Agent
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

SLEEP = [PY, "-c", "import time; time.sleep(120)"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _task(svc: ClusterService, arn: str) -> dict:
    return svc.describe_tasks({"tasks": [arn]})["tasks"][0]


def _pid(svc: ClusterService, arn: str) -> int:
    return svc.store.query("SELECT pid FROM tasks WHERE arn = ?", (arn,))[0]["pid"]


def test_server_kill9_and_restart_reconciles(tmp_path):
    db, work = str(tmp_path / "c.db"), str(tmp_path / "agent")
    svc = ClusterService(Store(db), seed=0)  # the test reads the same store directly
    svc.create_cluster({})
    trn = add_instance(svc, "trn1.32xlarge")
    add_instance(svc, "p4d.24xlarge")
    register(svc, "long", neuron_all(command=SLEEP))
    register(svc, "gpu_long", gpus(1, command=SLEEP))
    register(svc, "gpu_exit7", gpus(2, command=[PY, "-c", "import time; time.sleep(2); exit(7)"]))
    register(svc, "gpu_quick", gpus(1, command=[PY, "-c", "print('hello')"]))
    server = ServerProcess(db, work)
    try:
        long_arn = svc.run_task({"taskDefinition": "long"})["tasks"][0]["taskArn"]
        killed_arn = svc.run_task({"taskDefinition": "gpu_long"})["tasks"][0]["taskArn"]
        exit7_arn = svc.run_task({"taskDefinition": "gpu_exit7"})["tasks"][0]["taskArn"]
        for arn in (long_arn, killed_arn, exit7_arn):
            wait_for(lambda arn=arn: _task(svc, arn)["lastStatus"] == "RUNNING", timeout=30)
        long_pid, killed_pid = _pid(svc, long_arn), _pid(svc, killed_arn)

        server.kill()  # kill -9: the agent dies with it, the task processes live on
        assert _alive(long_pid) and _alive(killed_pid)
        os.killpg(killed_pid, signal.SIGKILL)  # one task dies while nobody watches
        wait_for(lambda: not _alive(killed_pid), timeout=10)
        time.sleep(2.5)  # let gpu_exit7 finish on its own while the agent is down
        queued_arn = svc.run_task({"taskDefinition": "gpu_quick"})["tasks"][0]["taskArn"]
        assert _task(svc, queued_arn)["lastStatus"] == "PROVISIONING"

        server = ServerProcess(db, work)  # restart: reconcile
        client = boto3.client(
            "ecs",
            endpoint_url=server.url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        exit7 = wait_for(lambda: (t := _task(svc, exit7_arn))["lastStatus"] == "STOPPED" and t, 20)
        assert exit7["containers"][0]["exitCode"] == 7
        killed = wait_for(
            lambda: (t := _task(svc, killed_arn))["lastStatus"] == "STOPPED" and t, 20
        )
        assert "agent was down" in killed["stoppedReason"]
        queued = wait_for(
            lambda: (t := _task(svc, queued_arn))["lastStatus"] == "STOPPED" and t, 20
        )
        assert queued["containers"][0]["exitCode"] == 0  # queued while down: run, not lost

        long_task = _task(svc, long_arn)
        assert (
            long_task["lastStatus"] == "RUNNING" and _pid(svc, long_arn) == long_pid
        )  # re-adopted
        stats = check_invariants(svc.store)
        assert stats == {"active": 1, "held": 16}  # only the re-adopted task holds devices

        client.stop_task(cluster="default", task=long_arn)
        wait_for(lambda: _task(svc, long_arn)["lastStatus"] == "STOPPED", timeout=20)
        wait_for(lambda: not _alive(long_pid), timeout=10)
        assert check_invariants(svc.store) == {"active": 0, "held": 0}
        ci = svc.describe_container_instances({"containerInstances": [trn]})["containerInstances"][
            0
        ]
        assert ci["remainingResources"] == ci["registeredResources"]
        assert ci["runningTasksCount"] == 0
    finally:
        server.terminate()
        kill_task_processes(svc.store)


@pytest.fixture
def svc(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    yield s
    kill_task_processes(s.store)


def test_claimed_but_never_started_task_is_started_after_restart(svc, tmp_path):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "q", neuron_all(command=[PY, "-c", "pass"]))
    arn = svc.run_task({"taskDefinition": "q"})["tasks"][0]["taskArn"]
    agent_dir = str(tmp_path / "agent")
    assert svc.claim_task(arn, os.path.join(agent_dir, arn.rsplit("/", 1)[1]))  # then "crash"
    Agent(svc, agent_dir).step()
    t = wait_for(
        lambda: (
            (Agent(svc, agent_dir).step(), _task(svc, arn))[1]["lastStatus"] == "STOPPED"
            and _task(svc, arn)
        ),
        timeout=20,
    )
    assert t["containers"][0]["exitCode"] == 0


def test_unrecorded_process_is_adopted_not_duplicated(svc, tmp_path, monkeypatch):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "s", neuron_all(command=[PY, "-c", "import time; time.sleep(120)"]))
    arn = svc.run_task({"taskDefinition": "s"})["tasks"][0]["taskArn"]
    agent_dir = str(tmp_path / "agent")
    first = Agent(svc, agent_dir)
    with monkeypatch.context() as m:  # crash after starting the process, before recording it
        m.setattr(svc, "mark_running", lambda *a, **k: None)
        first.step()
    [proc] = first._runs[arn].procs.values()
    wait_for(lambda: os.path.exists(proc.prefix + ".pid"), timeout=10)
    second = Agent(svc, agent_dir)
    second.step()
    assert _task(svc, arn)["lastStatus"] == "RUNNING"
    assert _pid(svc, arn) == proc.pid  # the same process, not a second copy
    svc.stop_task({"task": arn})
    wait_for(lambda: (second.step(), _task(svc, arn))[1]["lastStatus"] == "STOPPED", timeout=20)
    assert not _alive(proc.pid) or proc.popen.wait(timeout=5) is not None


def test_reused_pid_is_not_adopted_or_killed(svc, tmp_path):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "s", neuron_all())
    arn = svc.run_task({"taskDefinition": "s"})["tasks"][0]["taskArn"]
    svc.claim_task(arn, str(tmp_path / "gone"))
    svc.mark_running(arn, [(os.getpid(), 1.0)])  # a live pid with the wrong start time
    Agent(svc, str(tmp_path / "agent")).step()
    t = _task(svc, arn)
    assert t["lastStatus"] == "STOPPED" and "agent was down" in t["stoppedReason"]
    assert check_invariants(svc.store) == {"active": 0, "held": 0}
