"""Issue 15 findings 1 and 2: launch failures, process groups, stopTimeout, orphans, essential."""

from __future__ import annotations

import os
import time

import psutil
import pytest
from cluster_testlib import (
    PY,
    add_instance,
    check_invariants,
    container,
    kill_task_processes,
    neuron_all,
    register,
    wait_for,
)

from kiln.cluster import taskdef
from kiln.cluster.agent import Agent
from kiln.cluster.errors import ClientException
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

# SIGTERM handler that takes a while (a checkpoint), plus a child that escaped with setsid.
CHECKPOINTS = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
open("child.pid", "w").write(str(child.pid))
def on_term(*_):
    time.sleep(1.5)
    open("checkpoint.done", "w").write("ok")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open("ready", "w").write("1")
time.sleep(120)
"""
IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open("ready", "w").write("1")
time.sleep(120)
"""


@pytest.fixture
def env(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    svc.create_cluster({})
    agent = Agent(svc, str(tmp_path / "agent"), poll_interval=0.05)
    agent.start()
    try:
        yield svc, agent, tmp_path
    finally:
        agent.stop()
        kill_task_processes(svc.store)
        check_invariants(svc.store)


def _task(svc, arn):
    return svc.describe_tasks({"tasks": [arn]})["tasks"][0]


def _held(svc) -> int:
    return svc.store.query("SELECT COUNT(*) AS n FROM devices WHERE task_arn IS NOT NULL")[0]["n"]


def _read(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize(
    "variable",
    [{"name": "A=B", "value": "1"}, {"name": "A\0B", "value": "1"}, {"name": "A", "value": "x\0"}],
)
def test_unlaunchable_environment_is_refused_at_registration(env, variable):
    svc, _agent, _ = env
    with pytest.raises(ClientException, match="environment"):
        register(svc, "bad", container(environment=[variable]))


def test_nul_in_command_is_refused_at_registration(env):
    svc, _agent, _ = env
    with pytest.raises(ClientException, match="NUL"):
        register(svc, "bad", container(command=[PY, "-c", "pass\0"]))


def test_launch_failure_stops_that_task_and_not_the_others(env, monkeypatch):
    svc, _agent, _ = env
    add_instance(svc, "trn1.32xlarge")
    add_instance(svc, "trn1.2xlarge")
    with monkeypatch.context() as m:  # a definition from before validation existed
        m.setattr(taskdef, "_check_launchable", lambda *a: None)
        register(svc, "bad", neuron_all(environment=[{"name": "A=B", "value": "1"}]))
    register(svc, "good", container(command=[PY, "-c", "print('fine')"]))
    bad = svc.run_task({"taskDefinition": "bad", "count": 2})["tasks"]
    good = svc.run_task({"taskDefinition": "good"})["tasks"][0]["taskArn"]
    for t in bad:
        done = wait_for(lambda t=t: _task(svc, t["taskArn"])["lastStatus"] == "STOPPED" and t)
        stopped = _task(svc, done["taskArn"])
        assert stopped["stopCode"] == "TaskFailedToStart"
        assert "CannotStartContainerError" in stopped["stoppedReason"]
    t = wait_for(lambda: _task(svc, good)["lastStatus"] == "STOPPED" and _task(svc, good))
    assert t["containers"][0]["exitCode"] == 0
    assert _held(svc) == 0


def test_stop_waits_for_every_process_then_frees_devices(env):
    svc, agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    register(svc, "ckpt", neuron_all(command=[PY, "-c", CHECKPOINTS]))
    arn = svc.run_task({"taskDefinition": "ckpt"})["tasks"][0]["taskArn"]
    task_dir = os.path.join(agent.work_dir, arn.rsplit("/", 1)[1])
    wait_for(lambda: os.path.exists(os.path.join(task_dir, "ready")))
    child = _read(os.path.join(task_dir, "child.pid"))
    assert _alive(child)
    held = _held(svc)
    assert held == 1
    svc.stop_task({"task": arn})
    time.sleep(0.8)  # the workload is still checkpointing: its devices stay held
    assert _task(svc, arn)["lastStatus"] != "STOPPED" and _held(svc) == held
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    assert os.path.exists(os.path.join(task_dir, "checkpoint.done"))
    assert t["containers"][0]["exitCode"] == 0
    assert not _alive(child)  # the setsid child was found by its marker and ended
    assert _held(svc) == 0


def test_stop_timeout_then_sigkill(env):
    svc, agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    register(svc, "stubborn", neuron_all(command=[PY, "-c", IGNORES_TERM], stopTimeout=2))
    arn = svc.run_task({"taskDefinition": "stubborn"})["tasks"][0]["taskArn"]
    task_dir = os.path.join(agent.work_dir, arn.rsplit("/", 1)[1])
    wait_for(lambda: os.path.exists(os.path.join(task_dir, "ready")))
    began = time.monotonic()
    svc.stop_task({"task": arn})
    time.sleep(1.0)
    assert _task(svc, arn)["lastStatus"] != "STOPPED"
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    assert time.monotonic() - began >= 2.0
    assert t["containers"][0]["exitCode"] == 137  # SIGKILL
    assert _held(svc) == 0


def test_background_child_of_an_exited_task_is_killed(env):
    svc, agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    script = (
        "import subprocess, sys\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True)\n"
        "open('child.pid', 'w').write(str(c.pid))\n"
    )
    register(svc, "leaky", neuron_all(command=[PY, "-c", script]))
    arn = svc.run_task({"taskDefinition": "leaky"})["tasks"][0]["taskArn"]
    wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED")
    child = _read(os.path.join(agent.work_dir, arn.rsplit("/", 1)[1], "child.pid"))
    assert not _alive(child)


def test_non_essential_exit_keeps_the_task_and_depends_on_orders_start(env):
    svc, _agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    setup = container("setup", command=[PY, "-c", "open('setup.done', 'w').write('1')"])
    setup["essential"] = False
    main = container(
        "main",
        command=[PY, "-c", "import os, time; assert os.path.exists('setup.done'); time.sleep(1)"],
        dependsOn=[{"containerName": "setup", "condition": "SUCCESS"}],
    )
    register(svc, "ordered", setup, main)
    arn = svc.run_task({"taskDefinition": "ordered"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    codes = {c["name"]: c.get("exitCode") for c in t["containers"]}
    assert codes == {"setup": 0, "main": 0}
    assert "exit code 0" in t["stoppedReason"]


def test_dependency_cycle_and_unknown_container_are_refused(env):
    svc, _agent, _ = env
    a = container("a", dependsOn=[{"containerName": "b", "condition": "START"}])
    b = container("b", dependsOn=[{"containerName": "a", "condition": "START"}])
    with pytest.raises(ClientException, match="cycle"):
        register(svc, "cyc", a, b)
    with pytest.raises(ClientException, match="not another container"):
        register(
            svc,
            "dangling",
            container("a", dependsOn=[{"containerName": "z", "condition": "START"}]),
        )


def test_task_environment_is_clean(env, monkeypatch):
    svc, agent, _ = env
    monkeypatch.setenv("SERVER_SECRET", "hunter2")
    add_instance(svc, "trn1.2xlarge")
    script = "import json, os; print(json.dumps(dict(os.environ)))"
    register(svc, "envdump", container(command=[PY, "-c", script]))
    arn = svc.run_task({"taskDefinition": "envdump"})["tasks"][0]["taskArn"]
    wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED")
    import json

    from kiln.cluster.agent import task_output

    seen = json.loads(task_output(agent.work_dir, arn).splitlines()[0])
    assert "SERVER_SECRET" not in seen
    assert seen["CLUSTER_TASK_ARN"] == arn
    log = os.path.join(agent.work_dir, arn.rsplit("/", 1)[1], "c0.log")
    assert os.stat(log).st_mode & 0o077 == 0
    assert os.stat(agent.work_dir).st_mode & 0o077 == 0


def test_logs_of_unknown_or_escaping_task_fail(env):
    from click.testing import CliRunner

    from kiln.cluster.cli import cluster as cluster_cli

    _svc, agent, tmp = env
    runner = CliRunner()
    base = ["--store", str(tmp / "c.db"), "logs", "--work-dir", agent.work_dir]
    r = runner.invoke(cluster_cli, [*base, "0123abcd"])
    assert r.exit_code == 1 and "no output for task" in r.output
    r = runner.invoke(cluster_cli, [*base, ".."])
    assert r.exit_code == 1 and "not a task id" in r.output


def test_log_is_capped_with_rotation(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    svc.create_cluster({})
    agent = Agent(svc, str(tmp_path / "agent"), poll_interval=0.05, log_cap_bytes=64 * 1024)
    agent.start()
    try:
        add_instance(svc, "trn1.2xlarge")
        script = "import sys, time\nfor _ in range(200):\n    print('x' * 4000, flush=True); time.sleep(0.01)\n"
        register(svc, "chatty", container(command=[PY, "-c", script]))
        arn = svc.run_task({"taskDefinition": "chatty"})["tasks"][0]["taskArn"]
        wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED", timeout=30)
    finally:
        agent.stop()
    log = os.path.join(agent.work_dir, arn.rsplit("/", 1)[1], "c0.log")
    assert os.path.exists(log + ".1")
    assert os.path.getsize(log + ".1") < 800_000  # 800 kB written; at most cap + one pass kept


def test_killing_the_wrapper_still_ends_the_whole_task(env):
    svc, agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    register(svc, "ckpt", neuron_all(command=[PY, "-c", CHECKPOINTS]))
    arn = svc.run_task({"taskDefinition": "ckpt"})["tasks"][0]["taskArn"]
    task_dir = os.path.join(agent.work_dir, arn.rsplit("/", 1)[1])
    wait_for(lambda: os.path.exists(os.path.join(task_dir, "ready")))
    child = _read(os.path.join(task_dir, "child.pid"))
    wrapper = svc.store.query("SELECT pid FROM tasks WHERE arn = ?", (arn,))[0]["pid"]
    os.kill(wrapper, 9)  # the recorded pid dies; the workload and its setsid child do not
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    assert os.path.exists(os.path.join(task_dir, "checkpoint.done"))  # SIGTERM, then waited
    assert not _alive(child) and _held(svc) == 0
    assert t["containers"][0]["exitCode"] == 137


@pytest.mark.skipif(os.getuid() != 0, reason="switching users needs root")
def test_user_is_honoured_when_the_agent_is_root(env):
    svc, agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    register(
        svc,
        "as-nobody",
        container(command=["sh", "-c", "id -u; pwd"], user="nobody", workingDirectory="/tmp"),
    )
    arn = svc.run_task({"taskDefinition": "as-nobody"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    from kiln.cluster.agent import task_output

    assert t["containers"][0]["exitCode"] == 0, t
    assert task_output(agent.work_dir, arn).split() == ["65534", "/tmp"]


def test_unknown_user_fails_that_task_with_a_reason(env):
    svc, _agent, _ = env
    add_instance(svc, "trn1.2xlarge")
    register(svc, "ghost", container(user="no-such-user-kiln"))
    arn = svc.run_task({"taskDefinition": "ghost"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _task(svc, arn)["lastStatus"] == "STOPPED" and _task(svc, arn))
    assert t["stopCode"] == "TaskFailedToStart" and "does not exist" in t["stoppedReason"]
