"""The agent: processes, device environment, captured output, stop, device-file checks."""

from __future__ import annotations

import json
import os

import psutil
import pytest
from click.testing import CliRunner
from cluster_testlib import (
    PY,
    add_instance,
    check_invariants,
    container,
    gpus,
    kill_task_processes,
    neuron_all,
    register,
    wait_for,
)

from kiln.cluster.agent import Agent, task_output
from kiln.cluster.cli import cluster as cluster_cli
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

DUMP_AND_EXIT = (
    "import json, os, sys\n"
    "keys = ['NEURON_RT_VISIBLE_CORES', 'AWS_NEURON_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES',"
    " 'CUDA_VISIBLE_DEVICES', 'GREETING']\n"
    "print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)\n"
    "sys.exit(3)\n"
)
SLEEP = [PY, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def env(tmp_path):
    db = str(tmp_path / "c.db")
    svc = ClusterService(Store(db), seed=0)
    svc.create_cluster({})
    agent = Agent(svc, str(tmp_path / "agent"), poll_interval=0.05)
    agent.start()
    try:
        yield svc, agent
    finally:
        agent.stop()
        kill_task_processes(svc.store)


def _describe(svc, arn):
    return svc.describe_tasks({"tasks": [arn]})["tasks"][0]


def _stopped(svc, arn):
    t = _describe(svc, arn)
    return t if t["lastStatus"] == "STOPPED" else None


def test_runs_command_with_neuron_env_and_reports_exit(env):
    svc, agent = env
    add_instance(svc, "trn1.32xlarge")
    c = neuron_all(
        command=[PY, "-c", DUMP_AND_EXIT], environment=[{"name": "GREETING", "value": "hi"}]
    )
    register(svc, "dump", c)
    arn = svc.run_task({"taskDefinition": "dump"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _stopped(svc, arn), timeout=20)
    assert t["containers"][0]["exitCode"] == 3
    assert "exit code 3" in t["stoppedReason"]
    out = json.loads(task_output(agent.work_dir, arn).splitlines()[0])
    assert out["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert out["AWS_NEURON_VISIBLE_DEVICES"] == ",".join(map(str, range(16)))
    assert out["GREETING"] == "hi" and out["NVIDIA_VISIBLE_DEVICES"] is None
    check_invariants(svc.store)
    assert (
        svc.store.query("SELECT COUNT(*) AS n FROM devices WHERE task_arn IS NOT NULL")[0]["n"] == 0
    )


def test_gpu_env_matches_gpu_ids(env):
    svc, agent = env
    add_instance(svc, "p4d.24xlarge")
    register(svc, "g", gpus(2, command=[PY, "-c", DUMP_AND_EXIT]))
    first = svc.run_task({"taskDefinition": "g"})["tasks"][0]["taskArn"]
    second = svc.run_task({"taskDefinition": "g"})["tasks"][0]["taskArn"]
    seen = []
    for arn in (first, second):
        t = wait_for(lambda arn=arn: _stopped(svc, arn), timeout=20)
        out = json.loads(task_output(agent.work_dir, arn).splitlines()[0])
        assert out["NVIDIA_VISIBLE_DEVICES"].split(",") == t["containers"][0]["gpuIds"]
        seen.append(out["CUDA_VISIBLE_DEVICES"])
    assert len(set(",".join(seen).split(","))) == 4  # four distinct GPUs over both tasks


def test_stop_task_ends_process_and_frees_devices(env):
    svc, _agent = env
    inst = add_instance(svc, "trn1.32xlarge")
    register(svc, "sleep", neuron_all(command=SLEEP))
    arn = svc.run_task({"taskDefinition": "sleep"})["tasks"][0]["taskArn"]
    wait_for(lambda: _describe(svc, arn)["lastStatus"] == "RUNNING", timeout=20)
    pid = svc.store.query("SELECT pid FROM tasks WHERE arn = ?", (arn,))[0]["pid"]
    assert psutil.pid_exists(pid)
    svc.stop_task({"task": arn})
    t = wait_for(lambda: _stopped(svc, arn), timeout=20)
    assert t["stopCode"] == "UserInitiated"
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", 10)
    ci = svc.describe_container_instances({"containerInstances": [inst]})["containerInstances"][0]
    assert ci["remainingResources"] == ci["registeredResources"]


def _fake_root(root, n: int, missing: int | None = None, sysfs: bool = False) -> str:
    os.makedirs(os.path.join(root, "dev"), exist_ok=True)
    for i in range(n):
        if i != missing:
            open(os.path.join(root, "dev", f"neuron{i}"), "w").close()
        if sysfs:
            d = os.path.join(root, "sys", "class", "neuron_device", f"neuron{i}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "core_count"), "w") as f:
                f.write("2\n")
    return str(root)


def test_missing_device_file_stops_task_with_reason(env, tmp_path):
    svc, _ = env
    root = _fake_root(tmp_path / "root", 16, missing=7)
    add_instance(svc, "trn1.32xlarge", attributes={"kiln.device-root": root})
    register(svc, "n", neuron_all())
    arn = svc.run_task({"taskDefinition": "n"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _stopped(svc, arn), timeout=20)
    assert t["stopCode"] == "TaskFailedToStart"
    assert "/dev/neuron7" in t["stoppedReason"]
    assert (
        svc.store.query("SELECT COUNT(*) AS n FROM devices WHERE task_arn IS NOT NULL")[0]["n"] == 0
    )


def test_simulated_instance_without_root_skips_file_check(env):
    svc, _ = env
    assert not os.path.exists("/dev/neuron0")
    add_instance(svc, "trn1.2xlarge")
    register(svc, "n", neuron_all(command=[PY, "-c", "pass"]))
    arn = svc.run_task({"taskDefinition": "n"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _stopped(svc, arn), timeout=20)
    assert t["containers"][0]["exitCode"] == 0


def test_add_instance_discovers_devices_under_root(tmp_path):
    root = _fake_root(tmp_path / "root", 2, sysfs=True)
    db = str(tmp_path / "c.db")
    result = CliRunner().invoke(
        cluster_cli,
        ["--store", db, "add-instance", "--type", "trn1.2xlarge", "--device-root", root],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)["containerInstance"]
    reg = {r["name"]: r for r in doc["registeredResources"]}
    assert reg["NEURON"]["stringSetValue"] == ["0", "1"]
    empty = CliRunner().invoke(
        cluster_cli,
        ["--store", db, "add-instance", "--type", "trn1.2xlarge", "--device-root", str(tmp_path)],
    )
    assert empty.exit_code != 0 and "no devices" in empty.output


def test_container_without_command_fails_to_start(env):
    svc, _ = env
    add_instance(svc, "trn1.2xlarge")
    c = container()
    c.pop("command")
    register(svc, "nocmd", c)
    arn = svc.run_task({"taskDefinition": "nocmd"})["tasks"][0]["taskArn"]
    t = wait_for(lambda: _stopped(svc, arn), timeout=20)
    assert t["stopCode"] == "TaskFailedToStart" and "no command" in t["stoppedReason"]
