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
