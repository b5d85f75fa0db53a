"""What ECS scripts rely on and a user trial found wrong (2026-12-06): ListTasks's ``serviceName``
and ``launchType`` filters, ListTaskDefinitions's ``familyPrefix`` (the whole family name) and
ListTaskDefinitionFamilies's ``status``, RunTask's container overrides (unknown containers
refused, device requirements honoured), and tasks on a force-deregistered container instance
(stopped, their devices freed)."""

from __future__ import annotations

import psutil
import pytest
from cluster_testlib import (
    PY,
    add_instance,
    check_invariants,
    container,
    gpus,
    register,
    wait_for,
)

from kiln.cluster.errors import InvalidParameterException, ServiceNotFoundException
from kiln.cluster.store import loads

SLEEP = [PY, "-c", "import time; time.sleep(120)"]


def _families(svc, **body) -> list[str]:
    return svc.call("ListTaskDefinitionFamilies", body)["families"]


def test_list_tasks_honours_service_name_and_launch_type(svc):
    add_instance(svc, "trn1.32xlarge")
    register(svc, "job", container())
    mine = svc.run_task({"taskDefinition": "job", "count": 2, "startedBy": "batch-42"})
    assert len(mine["tasks"]) == 2
    svc.call("CreateService", {"serviceName": "api", "taskDefinition": "job", "desiredCount": 1})
    svc.reconcile_services()
    [service_task] = svc.list_tasks({"startedBy": "ecs-svc/api"})["taskArns"]
    assert svc.call("ListTasks", {"serviceName": "api"})["taskArns"] == [service_task]
    with pytest.raises(ServiceNotFoundException):
        svc.call("ListTasks", {"serviceName": "no-such-service"})
    assert len(svc.call("ListTasks", {"launchType": "EC2"})["taskArns"]) == 3
    assert svc.call("ListTasks", {"launchType": "FARGATE"})["taskArns"] == []
    assert svc.call("ListTasks", {"launchType": "EXTERNAL"})["taskArns"] == []
    svc.call("UpdateService", {"service": "api", "desiredCount": 0})
    svc.reconcile_services()


def test_list_task_definitions_family_prefix_is_the_whole_family(svc):
    for family in ("train", "train-eval"):
        register(svc, family, container())
    out = svc.call("ListTaskDefinitions", {"familyPrefix": "train", "sort": "DESC"})
    assert [a.rsplit("/", 1)[1] for a in out["taskDefinitionArns"]] == ["train:1"]
    assert _families(svc, familyPrefix="train") == ["train", "train-eval"]  # a true prefix here


def test_list_task_definition_families_honours_status(svc):
    for family in ("live", "gone"):
        register(svc, family, container())
    svc.deregister_task_definition({"taskDefinition": "gone:1"})
    assert _families(svc) == ["gone", "live"]  # default ALL, as in the service
    assert _families(svc, status="ALL") == ["gone", "live"]
    assert _families(svc, status="ACTIVE") == ["live"]
    assert _families(svc, status="INACTIVE") == ["gone"]
    svc.deregister_task_definition({"taskDefinition": "live:1"})
    register(svc, "live", container())  # live:2 is ACTIVE: the family is not INACTIVE
    assert _families(svc, status="INACTIVE") == ["gone"]
    assert _families(svc, status="ACTIVE", familyPrefix="li") == ["live"]


def test_container_override_resource_requirements_reserve_devices(svc):
    inst = add_instance(svc, "g5.12xlarge")  # 4 GPUs
    register(svc, "o", container())
    override = {"name": "main", "resourceRequirements": [{"type": "GPU", "value": "2"}]}
    body = {"taskDefinition": "o", "overrides": {"containerOverrides": [override]}}
    first, second = (svc.call("RunTask", dict(body))["tasks"][0] for _ in range(2))
    ids = first["containers"][0]["gpuIds"] + second["containers"][0]["gpuIds"]
    assert len(first["containers"][0]["gpuIds"]) == 2 and sorted(ids) == sorted(set(ids))
    out = svc.call("RunTask", dict(body))
    assert out["tasks"] == [] and out["failures"] == [{"arn": inst, "reason": "RESOURCE:GPU"}]
    stored = loads(
        svc.store.query("SELECT containers FROM tasks WHERE arn = ?", (first["taskArn"],))[0][
            "containers"
        ]
    )
    assert [d["kind"] for d in stored[0]["devices"]] == ["gpu", "gpu"]  # what the agent hands over
    check_invariants(svc.store)


def test_container_override_errors_are_named(svc):
    add_instance(svc, "g5.12xlarge")
    register(svc, "o", container())
    register(svc, "n", container(resourceRequirements=[{"type": "NeuronDevice", "value": "ALL"}]))

    def run(family: str, *overrides: dict) -> None:
        body = {"taskDefinition": family, "overrides": {"containerOverrides": list(overrides)}}
        svc.call("RunTask", body)

    with pytest.raises(InvalidParameterException, match="container named typo is not a container"):
        run("o", {"name": "typo", "command": ["false"]})
    with pytest.raises(InvalidParameterException, match="second override"):
        run("o", {"name": "main"}, {"name": "main"})
    with pytest.raises(InvalidParameterException, match="GPU value must be a positive integer"):
        run("o", {"name": "main", "resourceRequirements": [{"type": "GPU", "value": "0"}]})
    with pytest.raises(InvalidParameterException, match="both NeuronDevice"):
        run("n", {"name": "main", "resourceRequirements": [{"type": "GPU", "value": "1"}]})
    assert svc.list_tasks({})["taskArns"] == []


def test_force_deregistration_stops_the_instances_tasks(served):
    svc = served
    inst = add_instance(svc, "g5.xlarge")
    register(svc, "s", gpus(1, command=SLEEP, stopTimeout=2))
    arn = svc.run_task({"taskDefinition": "s"})["tasks"][0]["taskArn"]

    def task() -> dict:
        return svc.describe_tasks({"tasks": [arn]})["tasks"][0]

    wait_for(lambda: task()["lastStatus"] == "RUNNING")
    [c] = loads(
        svc.store.query("SELECT containers FROM tasks WHERE arn = ?", (arn,))[0]["containers"]
    )
    svc.deregister_container_instance({"containerInstance": inst, "force": True})
    svc.stop_task({"task": arn, "reason": "cleanup"})  # accepted, and idempotent
    t = wait_for(lambda: task() if task()["lastStatus"] == "STOPPED" else None)
    assert "deregistered" in t["stoppedReason"] and t["stopCode"] == "UserInitiated"
    assert not psutil.pid_exists(c["pid"]) or psutil.Process(c["pid"]).status() == "zombie"
    assert svc.describe_clusters({})["clusters"][0]["runningTasksCount"] == 0
    held = svc.store.query("SELECT COUNT(*) AS n FROM devices WHERE task_arn IS NOT NULL")
    assert held[0]["n"] == 0
    check_invariants(svc.store)
