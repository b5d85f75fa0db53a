"""Issue 15 finding 9: cluster scoping, idempotent clientToken, agent heartbeat."""

from __future__ import annotations

import time

import pytest
from cluster_testlib import add_instance, container, register

from kiln.cluster.errors import InvalidParameterException
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store


@pytest.fixture
def svc(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    s.create_cluster({"clusterName": "other"})
    return s


def test_actions_are_scoped_to_their_cluster(svc):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "t", container())
    arn = svc.run_task({"taskDefinition": "t"})["tasks"][0]["taskArn"]
    out = svc.describe_tasks({"cluster": "other", "tasks": [arn]})
    assert out["tasks"] == [] and out["failures"] == [{"arn": arn, "reason": "MISSING"}]
    with pytest.raises(InvalidParameterException, match="not found"):
        svc.stop_task({"cluster": "other", "task": arn})
    assert svc.describe_tasks({"tasks": [arn]})["tasks"][0]["desiredStatus"] == "RUNNING"
    assert svc.list_tasks({"cluster": "other"})["taskArns"] == []


def test_client_token_makes_run_task_idempotent(svc):
    add_instance(svc, "trn1.32xlarge")
    register(svc, "t", container())
    body = {"taskDefinition": "t", "count": 2, "clientToken": "retry-1"}
    first = svc.run_task(dict(body))
    again = svc.run_task(dict(body))
    assert [t["taskArn"] for t in again["tasks"]] == [t["taskArn"] for t in first["tasks"]]
    assert len(svc.list_tasks({})["taskArns"]) == 2
    with pytest.raises(InvalidParameterException, match="clientToken"):
        svc.run_task({**body, "count": 3})
    other = svc.run_task({**body, "clientToken": "retry-2"})
    assert len(other["tasks"]) == 2 and len(svc.list_tasks({})["taskArns"]) == 4


def test_agent_heartbeat_gates_placement_and_reaps_unclaimed_tasks(svc):
    svc.agent_timeout_s = 5.0
    inst = add_instance(svc, "trn1.2xlarge")
    register(svc, "t", container())
    arn = svc.run_task({"taskDefinition": "t"})["tasks"][0]["taskArn"]
    old = time.time() - 60
    with svc.store.transaction(exclusive=True) as tx:  # the agent went quiet a minute ago
        tx.execute("UPDATE container_instances SET heartbeat_at = ?", (old,))
        tx.execute("UPDATE tasks SET created_at = ?", (old,))
    doc = svc.describe_container_instances({"containerInstances": [inst]})["containerInstances"][0]
    assert doc["agentConnected"] is False
    out = svc.run_task({"taskDefinition": "t"})
    assert out["tasks"] == [] and out["failures"][0]["reason"] == "AGENT"
    assert svc.reap_disconnected() == [arn]
    t = svc.describe_tasks({"tasks": [arn]})["tasks"][0]
    assert t["lastStatus"] == "STOPPED" and "disconnected" in t["stoppedReason"]
    svc.heartbeat(inst)  # the agent is back
    doc = svc.describe_container_instances({"containerInstances": [inst]})["containerInstances"][0]
    assert doc["agentConnected"] is True
    assert len(svc.run_task({"taskDefinition": "t"})["tasks"]) == 1


def test_service_keeps_desired_count_and_replaces_failed_tasks(svc):
    add_instance(svc, "trn1.32xlarge")
    register(svc, "web", container())
    out = svc.call(
        "CreateService",
        {
            "serviceName": "api",
            "taskDefinition": "web",
            "desiredCount": 3,
            "tags": [{"key": "team", "value": "ml"}],
        },
    )
    arn = out["service"]["serviceArn"]
    assert svc.call("ListServices", {})["serviceArns"] == [arn]
    assert svc.reconcile_services() == {arn: 3}
    tasks = svc.list_tasks({"startedBy": "ecs-svc/api"})["taskArns"]
    assert len(tasks) == 3
    svc.stop_task({"task": tasks[0]})  # a copy fails: it is replaced
    assert svc.reconcile_services() == {arn: 1}
    assert len(svc.list_tasks({"startedBy": "ecs-svc/api"})["taskArns"]) == 3
    svc.call("UpdateService", {"service": "api", "desiredCount": 1})
    assert svc.reconcile_services() == {arn: -2}
    doc = svc.call("DescribeServices", {"services": ["api", "nope"]})
    assert doc["services"][0]["desiredCount"] == 1 and doc["services"][0]["pendingCount"] == 1
    assert doc["failures"] == [{"arn": "nope", "reason": "MISSING"}]
    assert svc.call("ListTagsForResource", {"resourceArn": arn})["tags"] == [
        {"key": "team", "value": "ml"}
    ]
    with pytest.raises(InvalidParameterException, match="scaled above 0"):
        svc.call("DeleteService", {"service": "api"})
    assert (
        svc.call("DeleteService", {"service": "api", "force": True})["service"]["status"]
        == "INACTIVE"
    )
    assert svc.list_tasks({"startedBy": "ecs-svc/api"})["taskArns"] == []
    assert svc.call("ListServices", {})["serviceArns"] == []
    assert svc.describe_clusters({})["clusters"][0]["activeServicesCount"] == 0


def test_tags_on_existing_resources_only(svc):
    from kiln.cluster.errors import ResourceNotFoundException

    cluster_arn = svc.describe_clusters({})["clusters"][0]["clusterArn"]
    svc.call(
        "TagResource",
        {
            "resourceArn": cluster_arn,
            "tags": [{"key": "a", "value": "1"}, {"key": "b", "value": "2"}],
        },
    )
    svc.call("UntagResource", {"resourceArn": cluster_arn, "tagKeys": ["a"]})
    assert svc.call("ListTagsForResource", {"resourceArn": cluster_arn})["tags"] == [
        {"key": "b", "value": "2"}
    ]
    with pytest.raises(ResourceNotFoundException):
        svc.call("ListTagsForResource", {"resourceArn": cluster_arn + "x"})
    with pytest.raises(InvalidParameterException):
        svc.call("TagResource", {"resourceArn": "not-an-arn", "tags": [{"key": "a", "value": "1"}]})
