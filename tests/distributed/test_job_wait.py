"""``DataParallelJob.wait``'s stop rules, against a scripted ECS client (no server, no processes):
a task that finishes with exit code 0 gives the others time to finish; a failed or stopped task
stops them at once."""

from __future__ import annotations

from typing import Any

import pytest

import kiln.distributed.job as job_mod
from kiln.distributed.job import DataParallelJob


class FakeEcs:
    """Tasks whose status follows a script: ``arn -> (polls before it stops, exit code,
    stopCode)``; ``stop_task`` stops a task at the next poll with exit code 143."""

    def __init__(self, script: dict[str, tuple[int, int, str]]) -> None:
        self.script = dict(script)
        self.polls = 0
        self.stops: list[str] = []

    def describe_tasks(self, cluster: str, tasks: list[str]) -> dict[str, Any]:
        self.polls += 1
        out = []
        for arn in tasks:
            after, code, stop_code = self.script[arn]
            done = self.polls > after
            out.append(
                {
                    "taskArn": arn,
                    "lastStatus": "STOPPED" if done else "RUNNING",
                    "stopCode": stop_code if done else None,
                    "containers": [{"exitCode": code if done else None}],
                }
            )
        return {"tasks": out}

    def stop_task(self, cluster: str, task: str, reason: str) -> None:
        self.stops.append(task)
        self.script[task] = (self.polls, 143, "UserInitiated")


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_mod.time, "sleep", lambda s: None)


def _job() -> DataParallelJob:
    return DataParallelJob("t", script="train.py", rdzv_endpoint="127.0.0.1:1")


def test_a_finished_task_lets_the_others_finish(fast: None) -> None:
    # task b ends (exit 0) at poll 2, task a five polls later: nobody is stopped
    ecs = FakeEcs(
        {"a": (7, 0, "EssentialContainerExited"), "b": (2, 0, "EssentialContainerExited")}
    )
    result = _job().wait(ecs, ["a", "b"])
    assert result["exitCodes"] == [0, 0]
    assert ecs.stops == []


def test_a_failed_task_stops_the_others_at_once(fast: None) -> None:
    ecs = FakeEcs({"a": (1000, 0, ""), "b": (2, 1, "EssentialContainerExited")})
    result = _job().wait(ecs, ["a", "b"])
    assert ecs.stops == ["a"]
    assert result["exitCodes"] == [143, 1]


def test_a_task_stopped_by_stop_task_stops_the_others(fast: None) -> None:
    ecs = FakeEcs({"a": (1000, 0, ""), "b": (2, 0, "UserInitiated")})
    _job().wait(ecs, ["a", "b"])
    assert ecs.stops == ["a"]


def test_the_others_are_stopped_after_the_grace_period(
    fast: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_mod, "FINISH_GRACE_S", 0.0)
    ecs = FakeEcs({"a": (10**6, 0, ""), "b": (2, 0, "EssentialContainerExited")})
    result = _job().wait(ecs, ["a", "b"])
    assert ecs.stops == ["a"]
    assert result["exitCodes"] == [143, 0]
