"""More places where the cluster did not behave as ECS scripts expect (a user trial, 2026-12-06):
a command that cannot be executed is a launch failure, RunTask refuses what Kiln cannot honour,
responses carry the fields ECS always returns, and DescribeServices has the ``deployments`` the
``services_stable`` waiter reads."""

from __future__ import annotations

import os

import boto3
import pytest
from cluster_testlib import (
    PY,
    ServerProcess,
    add_instance,
    container,
    kill_task_processes,
    register,
    wait_for,
)

from kiln.cluster.agent import task_output
from kiln.cluster.errors import ClientException, InvalidParameterException
from kiln.cluster.store import Store


def _stopped(svc, arn: str) -> dict:
    """The task once it is STOPPED."""

    def task() -> dict | None:
        t = svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]
        return t if t["lastStatus"] == "STOPPED" else None

    return wait_for(task)


# -- 1. a command that cannot be executed does not start --------------------------------------
def test_command_not_on_path_is_task_failed_to_start_naming_it(served):
    add_instance(served, "g5.xlarge")
    register(served, "nf", container("m", ["no-such-binary-xyz", "--flag"]))
    arn = served.call("RunTask", {"taskDefinition": "nf"})["tasks"][0]["taskArn"]
    task = _stopped(served, arn)
    assert task["stopCode"] == "TaskFailedToStart"
    assert "no-such-binary-xyz" in task["stoppedReason"]
    assert "not found in $PATH" in task["stoppedReason"]
    assert "exitCode" not in task["containers"][0]


def test_command_that_is_not_executable_is_task_failed_to_start(served, tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    os.chmod(script, 0o644)
    add_instance(served, "g5.xlarge")
    register(served, "nx", container("m", [str(script)]))
    arn = served.call("RunTask", {"taskDefinition": "nx"})["tasks"][0]["taskArn"]
    task = _stopped(served, arn)
    assert task["stopCode"] == "TaskFailedToStart"
    assert str(script) in task["stoppedReason"] and "not executable" in task["stoppedReason"]


def test_shell_message_about_the_command_does_not_name_the_agent_files(served, tmp_path):
    script = tmp_path / "bad-interp"
    script.write_text("#!/no/such/interpreter\n")
    os.chmod(script, 0o755)
    add_instance(served, "g5.xlarge")
    register(served, "bi", container("m", [str(script)]))
    arn = served.call("RunTask", {"taskDefinition": "bi"})["tasks"][0]["taskArn"]
    _stopped(served, arn)
    out = task_output(str(tmp_path / "agent"), arn)
    assert out.strip(), "the shell reports the failed exec"
    assert str(tmp_path / "agent") not in out
    assert out.startswith("bad-interp:"), out


def test_command_on_path_still_runs(served):
    add_instance(served, "g5.xlarge")
    register(served, "ok", container("m", ["sh", "-c", "exit 4"]))
    arn = served.call("RunTask", {"taskDefinition": "ok"})["tasks"][0]["taskArn"]
    task = _stopped(served, arn)
    assert task["stopCode"] == "EssentialContainerExited"
    assert {c["name"]: c.get("exitCode") for c in task["containers"]}["m"] == 4


# -- 2. RunTask refuses what Kiln would not honour ----------------------------------------------
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"launchType": "FARGATE"}, "launchType 'FARGATE' is not supported"),
        ({"launchType": "EXTERNAL"}, "launchType 'EXTERNAL' is not supported"),
        (
            {"capacityProviderStrategy": [{"capacityProvider": "my-cp", "weight": 1}]},
            "capacityProviderStrategy is not supported",
        ),
        (
            {"placementStrategy": [{"type": "binpack", "field": "gpu"}]},
            "placementStrategy[0]: binpack field must be cpu or memory, got 'gpu'",
        ),
        (
            {"placementStrategy": [{"type": "random"}, {"type": "spread"}]},
            "placementStrategy[1]: spread needs a field: instanceId, host or attribute:NAME",
        ),
        (
            {"placementStrategy": [{"type": "spread", "field": "zone"}]},
            "placementStrategy[0]: spread needs a field",
        ),
    ],
)
def test_run_task_refuses_what_it_would_not_honour(svc, extra, named):
    add_instance(svc, "g5.xlarge")
    register(svc, "e", container("m"))
    with pytest.raises(InvalidParameterException) as e:
        svc.call("RunTask", {"taskDefinition": "e", **extra})
    assert named in str(e.value)
    assert svc.call("ListTasks", {})["taskArns"] == []


def test_create_service_refuses_fargate_and_bad_strategy(svc):
    register(svc, "e", container("m"))
    for extra in (
        {"launchType": "FARGATE"},
        {"placementStrategy": [{"type": "binpack", "field": "gpu"}]},
    ):
        with pytest.raises(InvalidParameterException):
            svc.call("CreateService", {"serviceName": "w", "taskDefinition": "e", **extra})
    assert svc.call("ListServices", {})["serviceArns"] == []


def test_run_task_accepts_what_kiln_honours(svc):
    add_instance(svc, "g5.xlarge")
    register(svc, "e", container("m"))
    strategies = [
        {"type": "spread", "field": "attribute:ecs.availability-zone"},
        {"type": "spread", "field": "instanceId"},
        {"type": "binpack", "field": "memory"},
        {"type": "random"},
    ]
    body = {"taskDefinition": "e", "launchType": "EC2", "placementStrategy": strategies}
    tasks = svc.call("RunTask", body)["tasks"]
    assert len(tasks) == 1 and tasks[0]["launchType"] == "EC2"


# -- 3. the fields ECS always returns -----------------------------------------------------------
def test_task_definition_echoes_compatibilities(svc):
    body = {
        "family": "f",
        "requiresCompatibilities": ["EC2"],
        "containerDefinitions": [container("m", image="repo/img:1")],
    }
    td = svc.call("RegisterTaskDefinition", body)["taskDefinition"]
    assert td["compatibilities"] == ["EC2"] and td["requiresCompatibilities"] == ["EC2"]
    again = svc.call("DescribeTaskDefinition", {"taskDefinition": "f"})["taskDefinition"]
    assert again["compatibilities"] == ["EC2"]


def test_task_definition_requiring_fargate_is_refused(svc):
    body = {
        "family": "f",
        "requiresCompatibilities": ["EC2", "FARGATE"],
        "containerDefinitions": [container("m")],
    }
    with pytest.raises(ClientException, match=r"requiresCompatibilities: \['FARGATE'\]"):
        svc.call("RegisterTaskDefinition", body)


def test_task_shows_image_launch_type_and_availability_zone(svc):
    add_instance(svc, "g5.xlarge", attributes={"ecs.availability-zone": "us-west-2b"})
    register(svc, "f", container("m", image="repo/img:1"), container("p", essential=False))
    arn = svc.call("RunTask", {"taskDefinition": "f"})["tasks"][0]["taskArn"]
    task = svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]
    assert task["launchType"] == "EC2"
    assert task["availabilityZone"] == "us-west-2b"
    assert [c["image"] for c in task["containers"]] == ["repo/img:1", "local"]


def test_availability_zone_is_the_instances_and_no_image_is_invented(svc):
    inst = add_instance(svc, "g5.xlarge")
    register(svc, "f", container("m", image=None, command=["true"]))
    task = svc.call("RunTask", {"taskDefinition": "f"})["tasks"][0]
    described = svc.call("DescribeContainerInstances", {"containerInstances": [inst]})
    attrs = {a["name"]: a["value"] for a in described["containerInstances"][0]["attributes"]}
    assert task["availabilityZone"] == attrs["ecs.availability-zone"]
    assert "image" not in task["containers"][0]


# -- 4. DescribeServices has the deployments the services_stable waiter reads --------------------
def test_service_has_one_primary_deployment_with_its_counts(svc):
    add_instance(svc, "g5.xlarge")
    register(svc, "s", container("m"))
    svc.call("CreateService", {"serviceName": "web", "taskDefinition": "s", "desiredCount": 1})
    service = svc.call("DescribeServices", {"services": ["web"]})["services"][0]
    (dep,) = service["deployments"]
    assert dep["status"] == "PRIMARY" and dep["taskDefinition"] == service["taskDefinition"]
    assert (dep["desiredCount"], dep["runningCount"], dep["pendingCount"]) == (1, 0, 0)
    assert dep["rolloutState"] == "IN_PROGRESS" and dep["id"].startswith("ecs-svc/")
    svc.call("UpdateService", {"service": "web", "desiredCount": 0})
    service = svc.call("DescribeServices", {"services": ["web"]})["services"][0]
    assert service["deployments"][0]["rolloutState"] == "COMPLETED"


def test_services_stable_waiter_against_the_server(tmp_path):
    db, work = str(tmp_path / "c.db"), str(tmp_path / "agent")
    server = ServerProcess(db, work)
    try:
        client = boto3.client(
            "ecs",
            endpoint_url=server.url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        client.create_cluster(clusterName="default")
        client.register_container_instance(
            attributes=[{"name": "ecs.instance-type", "value": "g5.xlarge"}]
        )
        sleep = [PY, "-c", "import time; time.sleep(120)"]
        client.register_task_definition(
            family="s",
            containerDefinitions=[
                {"name": "m", "image": "x", "memory": 64, "command": sleep, "stopTimeout": 2}
            ],
        )
        client.create_service(serviceName="web", taskDefinition="s", desiredCount=1)
        waiter = client.get_waiter("services_stable")
        waiter.wait(services=["web"], WaiterConfig={"Delay": 1, "MaxAttempts": 30})
        service = client.describe_services(services=["web"])["services"][0]
        assert service["runningCount"] == service["desiredCount"] == 1
        assert service["deployments"][0]["rolloutState"] == "COMPLETED"
        client.update_service(service="web", desiredCount=0)
        client.delete_service(service="web")
    finally:
        server.terminate()
        kill_task_processes(Store(db))
