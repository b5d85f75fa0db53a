"""Where the scheduler did not behave as ECS scripts expect (a user trial, 2026-12-06): CLI errors
without tracebacks, tags kept and returned, per-container exit status and reason, and host-port
placement."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner
from cluster_testlib import PY, add_instance, container, register, wait_for

from kiln.cluster import cli
from kiln.cluster.errors import ClientException, ECSError, InvalidParameterException

SLEEP = [PY, "-c", "import time; time.sleep(120)"]


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str):
    return CliRunner().invoke(cli.cluster, list(args))


# -- 1. CLI errors are one line, never a traceback ---------------------------------------------
def test_cli_malformed_json_file_names_the_file_and_position(tmp_path):
    bad = tmp_path / "td.json"
    bad.write_text('{"family": "x"\n')
    result = _cli("--store", str(tmp_path / "c.db"), "register-task-definition", "--file", str(bad))
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert str(bad) in result.output and "line 2 column 1" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_json_file_that_is_not_an_object_is_refused(tmp_path):
    bad = tmp_path / "td.json"
    bad.write_text("[1, 2]")
    result = _cli("--store", str(tmp_path / "c.db"), "register-task-definition", "--file", str(bad))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "must hold a JSON object" in result.output


def test_cli_unreachable_endpoint_names_the_url_and_serve():
    url = f"http://127.0.0.1:{_free_port()}"
    result = _cli("--endpoint", url, "list-tasks")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert url in result.output and "kiln cluster serve" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_endpoint_that_is_not_a_url_is_named():
    result = _cli("--endpoint", "localhost8080", "list-tasks")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "'localhost8080' is not a URL" in result.output


def test_cli_unusable_store_is_one_line(tmp_path):
    result = _cli("--store", str(tmp_path), "list-tasks")  # a directory, not a file
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "cannot open the cluster store" in result.output and str(tmp_path) in result.output


# -- 2. tags given at creation are kept and returned -------------------------------------------
def test_tags_given_at_creation_are_stored_and_returned(svc):
    add_instance(svc, "g5.xlarge")
    td = svc.call(
        "RegisterTaskDefinition",
        {
            "family": "t",
            "containerDefinitions": [container(command=["true"])],
            "tags": [{"key": "team", "value": "ml"}],
        },
    )
    td_arn = td["taskDefinition"]["taskDefinitionArn"]
    assert td["tags"] == [{"key": "team", "value": "ml"}]
    described = svc.call("DescribeTaskDefinition", {"taskDefinition": "t", "include": ["TAGS"]})
    assert described["tags"] == [{"key": "team", "value": "ml"}]
    assert "tags" not in svc.call("DescribeTaskDefinition", {"taskDefinition": "t"})
    assert svc.call("ListTagsForResource", {"resourceArn": td_arn})["tags"] == [
        {"key": "team", "value": "ml"}
    ]

    run = svc.call("RunTask", {"taskDefinition": "t", "tags": [{"key": "run", "value": "42"}]})
    arn = run["tasks"][0]["taskArn"]
    assert run["tasks"][0]["tags"] == [{"key": "run", "value": "42"}]
    assert svc.call("ListTagsForResource", {"resourceArn": arn})["tags"] == [
        {"key": "run", "value": "42"}
    ]
    svc.call("TagResource", {"resourceArn": arn, "tags": [{"key": "owner", "value": "me"}]})
    task = svc.call("DescribeTasks", {"tasks": [arn], "include": ["TAGS"]})["tasks"][0]
    assert task["tags"] == [{"key": "owner", "value": "me"}, {"key": "run", "value": "42"}]
    assert "tags" not in svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]

    made = svc.call("CreateCluster", {"clusterName": "c2", "tags": [{"key": "k", "value": "v"}]})
    tags = svc.call("ListTagsForResource", {"resourceArn": made["cluster"]["clusterArn"]})["tags"]
    assert tags == [{"key": "k", "value": "v"}]


def test_run_task_propagates_task_definition_tags_on_request(svc):
    add_instance(svc, "g5.xlarge")
    register(svc, "t", container(command=["true"]), tags=[{"key": "team", "value": "ml"}])
    run = svc.call(
        "RunTask",
        {
            "taskDefinition": "t",
            "propagateTags": "TASK_DEFINITION",
            "tags": [{"key": "run", "value": "1"}],
        },
    )
    assert run["tasks"][0]["tags"] == [{"key": "run", "value": "1"}, {"key": "team", "value": "ml"}]
    with pytest.raises(InvalidParameterException, match="propagateTags SERVICE"):
        svc.call("RunTask", {"taskDefinition": "t", "propagateTags": "SERVICE"})


def test_creation_tags_are_validated_before_anything_is_created(svc):
    add_instance(svc, "g5.xlarge")
    register(svc, "t", container(command=["true"]))
    with pytest.raises(InvalidParameterException, match="each tag needs a key"):
        svc.call("RunTask", {"taskDefinition": "t", "tags": [{"value": "x"}]})
    assert svc.call("ListTasks", {})["taskArns"] == []
    with pytest.raises(ECSError):
        register(svc, "u", container(command=["true"]), tags=[{"value": "x"}])
    with pytest.raises(ClientException):
        svc.call("DescribeTaskDefinition", {"taskDefinition": "u"})


# -- 3. each container reports its own exit --------------------------------------------------
def _containers(svc, arn: str) -> dict[str, dict]:
    task = svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]
    return {c["name"]: c for c in task["containers"]}


def test_exited_non_essential_container_is_stopped_with_its_own_exit(served):
    svc = served
    add_instance(svc, "g5.xlarge")
    register(
        svc,
        "n",
        container("main", SLEEP),
        container("init", [PY, "-c", "raise SystemExit(7)"], essential=False),
        container(
            "after",
            SLEEP,
            essential=False,
            dependsOn=[{"containerName": "init", "condition": "COMPLETE"}],
        ),
    )
    arn = svc.call("RunTask", {"taskDefinition": "n"})["tasks"][0]["taskArn"]
    wait_for(lambda: _containers(svc, arn)["after"]["lastStatus"] == "RUNNING")
    mid = _containers(svc, arn)
    assert svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]["lastStatus"] == "RUNNING"
    assert (mid["init"]["lastStatus"], mid["init"]["exitCode"]) == ("STOPPED", 7)
    assert "reason" not in mid["init"]
    assert mid["main"]["lastStatus"] == "RUNNING" and "exitCode" not in mid["main"]

    svc.call("StopTask", {"task": arn, "reason": "done for today"})
    wait_for(
        lambda: svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]["lastStatus"] == "STOPPED"
    )
    end = _containers(svc, arn)
    assert (end["init"]["exitCode"], end["init"].get("reason")) == (7, None)
    for name in ("main", "after"):
        assert end[name]["lastStatus"] == "STOPPED"
        assert end[name]["reason"] == "done for today"


def test_essential_exit_reason_is_not_copied_to_the_container_that_exited(served):
    svc = served
    add_instance(svc, "g5.xlarge")
    register(
        svc,
        "e",
        container("main", [PY, "-c", "import time; time.sleep(0.5); raise SystemExit(5)"]),
        container("side", SLEEP, essential=False),
    )
    arn = svc.call("RunTask", {"taskDefinition": "e"})["tasks"][0]["taskArn"]
    wait_for(
        lambda: svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]["lastStatus"] == "STOPPED"
    )
    task = svc.call("DescribeTasks", {"tasks": [arn]})["tasks"][0]
    assert task["stoppedReason"] == "Essential container in task exited (exit code 5)"
    end = {c["name"]: c for c in task["containers"]}
    assert end["main"]["exitCode"] == 5 and "reason" not in end["main"]
    assert end["side"]["reason"] == task["stoppedReason"]


# -- 4. fixed host ports are placement resources ------------------------------------------------
def test_a_taken_host_port_is_resource_ports(svc):
    one = add_instance(svc, "g5.xlarge")
    web = container("web", portMappings=[{"containerPort": 80, "hostPort": 48124}])
    register(svc, "web", web)
    register(svc, "dyn", container("d", portMappings=[{"containerPort": 80, "hostPort": 0}]))
    run = svc.call("RunTask", {"taskDefinition": "web", "count": 2})
    assert len(run["tasks"]) == 1
    assert run["failures"] == [{"arn": one, "reason": "RESOURCE:PORTS"}]
    assert len(svc.call("RunTask", {"taskDefinition": "dyn", "count": 2})["tasks"]) == 2

    two = add_instance(svc, "g5.xlarge")
    again = svc.call("RunTask", {"taskDefinition": "web"})
    assert [t["containerInstanceArn"] for t in again["tasks"]] == [two]
    svc.call("StopTask", {"task": run["tasks"][0]["taskArn"]})
    svc.mark_stopped(run["tasks"][0]["taskArn"], 0, "Task stopped by user", "UserInitiated")
    assert len(svc.call("RunTask", {"taskDefinition": "web"})["tasks"]) == 1
