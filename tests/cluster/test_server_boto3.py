"""End to end: boto3's ECS client against ``kiln cluster serve`` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import boto3
import pytest
from click.testing import CliRunner
from cluster_testlib import PY, ServerProcess, kill_task_processes, wait_for

from kiln.cluster.cli import cluster as cluster_cli
from kiln.cluster.server import ClusterHTTPServer
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

ENV_DUMP = (
    "import json, os, time\n"
    "keys = ['NEURON_RT_VISIBLE_CORES', 'AWS_NEURON_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES']\n"
    "print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)\n"
    "time.sleep(120)\n"
)


def ecs(url: str, key: str = "x", secret: str = "x"):
    return boto3.client(
        "ecs",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )


@pytest.fixture
def server(tmp_path):
    db, work = str(tmp_path / "c.db"), str(tmp_path / "agent")
    srv = ServerProcess(db, work)
    srv.work_dir = work
    srv.db = db
    try:
        yield srv
    finally:
        srv.terminate()
        kill_task_processes(Store(db))


def _task(client, arn: str) -> dict:
    return client.describe_tasks(cluster="default", tasks=[arn])["tasks"][0]


def test_neuron_all_end_to_end(server):
    client = ecs(server.url)
    assert client.create_cluster(clusterName="default")["cluster"]["status"] == "ACTIVE"
    inst = client.register_container_instance(
        cluster="default", attributes=[{"name": "ecs.instance-type", "value": "trn1.32xlarge"}]
    )["containerInstance"]
    inst_arn = inst["containerInstanceArn"]
    td = client.register_task_definition(
        family="train",
        containerDefinitions=[
            {
                "name": "main",
                "image": "local",
                "cpu": 1024,
                "memory": 2048,
                "command": [PY, "-c", ENV_DUMP],
                "resourceRequirements": [{"type": "NeuronDevice", "value": "ALL"}],
            }
        ],
    )["taskDefinition"]
    assert td["taskDefinitionArn"] == "arn:aws:ecs:us-east-1:000000000000:task-definition/train:1"
    assert (
        client.describe_task_definition(taskDefinition="train:1")["taskDefinition"]["family"]
        == "train"
    )
    assert client.list_task_definitions()["taskDefinitionArns"] == [td["taskDefinitionArn"]]

    run = client.run_task(cluster="default", taskDefinition="train")
    assert run["failures"] == []
    arn = run["tasks"][0]["taskArn"]
    assert arn.startswith("arn:aws:ecs:us-east-1:000000000000:task/default/")
    wait_for(lambda: _task(client, arn)["lastStatus"] == "RUNNING", timeout=20)
    task = _task(client, arn)
    assert task["containers"][0]["neuronDeviceIds"] == [str(i) for i in range(16)]
    assert client.list_tasks(cluster="default")["taskArns"] == [arn]

    log = os.path.join(server.work_dir, arn.rsplit("/", 1)[1], "c0.log")
    line = wait_for(lambda: os.path.exists(log) and Path(log).read_text().strip(), timeout=20)
    env = json.loads(line.splitlines()[0])
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert env["AWS_NEURON_VISIBLE_DEVICES"] == ",".join(str(i) for i in range(16))

    second = client.run_task(cluster="default", taskDefinition="train")
    assert second["tasks"] == []
    assert second["failures"] == [{"arn": inst_arn, "reason": "RESOURCE:NEURON"}]

    ci = client.describe_container_instances(cluster="default", containerInstances=[inst_arn])
    remaining = {r["name"]: r for r in ci["containerInstances"][0]["remainingResources"]}
    assert remaining["NEURON"]["stringSetValue"] == []
    assert remaining["CPU"]["integerValue"] == 128 * 1024 - 1024

    client.stop_task(cluster="default", task=arn, reason="done")
    wait_for(lambda: _task(client, arn)["lastStatus"] == "STOPPED", timeout=20)
    stopped = _task(client, arn)
    assert stopped["stoppedReason"] == "done" and stopped["stopCode"] == "UserInitiated"
    ci = client.describe_container_instances(cluster="default", containerInstances=[inst_arn])
    ci = ci["containerInstances"][0]
    assert ci["remainingResources"] == ci["registeredResources"]

    third = client.run_task(cluster="default", taskDefinition="train")
    assert third["failures"] == [] and len(third["tasks"]) == 1
    client.stop_task(cluster="default", task=third["tasks"][0]["taskArn"])

    with pytest.raises(client.exceptions.ClientException):
        client.describe_task_definition(taskDefinition="missing")
    with pytest.raises(client.exceptions.ClusterNotFoundException):
        client.list_tasks(cluster="nope")
    drained = client.update_container_instances_state(
        cluster="default", containerInstances=[inst_arn], status="DRAINING"
    )
    assert drained["containerInstances"][0]["status"] == "DRAINING"
    assert client.list_container_instances(cluster="default")["containerInstanceArns"] == [inst_arn]
    client.deregister_task_definition(taskDefinition="train:1")
    assert client.list_task_definitions()["taskDefinitionArns"] == []


def test_token_is_required_when_set(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")))
    srv = ClusterHTTPServer("127.0.0.1", 0, svc, token="s3cret")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        with pytest.raises(ecs(srv.url).exceptions.AccessDeniedException):
            ecs(srv.url).list_clusters()
        # the token is not an access key id: SigV4 with it as the key is still refused
        with pytest.raises(ecs(srv.url).exceptions.AccessDeniedException):
            ecs(srv.url, key="s3cret").create_cluster()
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        out = CliRunner().invoke(
            cluster_cli, ["--endpoint", srv.url, "--token-file", str(token), "create-cluster"]
        )
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["cluster"]["clusterName"] == "default"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def test_refuses_non_loopback_without_token(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")))
    with pytest.raises(ValueError, match="token"):
        ClusterHTTPServer("0.0.0.0", 0, svc)
    result = CliRunner().invoke(
        cluster_cli, ["--store", str(tmp_path / "c.db"), "serve", "--host", "0.0.0.0", "--no-agent"]
    )
    assert result.exit_code != 0 and "token" in result.output
