"""A data-parallel job on the Kiln scheduler (``kiln cluster``), through its ECS API.

    job = DataParallelJob("train", script="train.py", nnodes=2, nproc_per_node=2,
                          rdzv_endpoint="10.0.0.1:29400", devices="NeuronDevice:ALL")
    ecs = boto3.client("ecs", endpoint_url="http://127.0.0.1:8080", ...)
    arns = job.submit(ecs)            # one task per node, each on its own instance
    result = job.wait(ecs, arns)      # {"exitCodes": [...], "stopped": [...]}; one stop stops all

The job is one task definition (a container that runs ``kiln run`` with the job's rendezvous
endpoint and id) and one RunTask per node, in the job's own task group with a
``distinctInstance`` constraint, so no two nodes share an instance.  Each RunTask fills in its
``--node-rank``.  The scheduler hands each task its devices (``NEURON_RT_VISIBLE_CORES``,
``CUDA_VISIBLE_DEVICES``); ``kiln run`` splits them, and the instance's cores, between the
node's workers.  :meth:`DataParallelJob.wait` stops the remaining tasks as soon as one task
stops, so a failed, killed or stopped node ends the whole job instead of leaving the others
waiting on it.

``rdzv_endpoint`` must be an address every node can reach on the instance that will host the
rendezvous store (the node whose address it is hosts it).  The scheduler does not report task
addresses, so the caller chooses it (for simulated instances on one machine: 127.0.0.1:PORT).
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class JobError(RuntimeError):
    pass


_DEVICE_TYPES = ("NeuronDevice", "GPU")
# How long the other tasks of a job may take to finish after one finished with exit code 0.
FINISH_GRACE_S = 120.0


@dataclass
class DataParallelJob:
    family: str
    script: str
    rdzv_endpoint: str
    nnodes: int = 2
    nproc_per_node: int = 1
    script_args: list[str] = field(default_factory=list)
    devices: str = ""  # "NeuronDevice:ALL", "GPU:4", or "" for CPU-only tasks
    cpu: int = 1024  # CPU units per task (1024 = one vCPU)
    memory: int = 2048  # MiB per task
    environment: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    rdzv_timeout: int = 120

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nnodes > 10:
            raise JobError(f"nnodes must be 1..10 (one RunTask per node), got {self.nnodes}")
        if ":" not in self.rdzv_endpoint:
            raise JobError(f"rdzv_endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        if self.devices:
            kind, _, value = self.devices.partition(":")
            if kind not in _DEVICE_TYPES or not value:
                raise JobError(f"devices must be NeuronDevice:ALL|N or GPU:N, got {self.devices!r}")

    @property
    def group(self) -> str:
        return f"kiln-job:{self.job_id}"

    def command(self, node_rank: int) -> list[str]:
        return [
            self.python,
            "-m",
            "kiln.tools.cli",
            "run",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--nnodes={self.nnodes}",
            f"--node-rank={node_rank}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.job_id}",
            f"--rdzv-timeout={self.rdzv_timeout}",
            self.script,
            *self.script_args,
        ]

    def task_definition(self) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": "main",
            "image": "local",
            "cpu": self.cpu,
            "memory": self.memory,
            "essential": True,
            "command": self.command(0),
            "environment": [{"name": k, "value": v} for k, v in sorted(self.environment.items())],
        }
        if self.devices:
            kind, _, value = self.devices.partition(":")
            container["resourceRequirements"] = [{"type": kind, "value": value}]
        return {"family": self.family, "containerDefinitions": [container]}

    def run_task_request(self, task_definition_arn: str, node_rank: int, cluster: str) -> dict:
        return {
            "cluster": cluster,
            "taskDefinition": task_definition_arn,
            "count": 1,
            "group": self.group,
            "startedBy": f"kiln-job-{self.job_id}"[:36],
            "placementConstraints": [{"type": "distinctInstance"}],
            "overrides": {
                "containerOverrides": [{"name": "main", "command": self.command(node_rank)}]
            },
        }

    # -- against the service ----------------------------------------------------------------
    def submit(self, ecs: Any, cluster: str = "default") -> list[str]:
        """Register the task definition and start one task per node; the task ARNs in node-rank
        order.  If a node cannot be placed, the nodes already started are stopped and
        :class:`JobError` names the placement failure."""
        td = ecs.register_task_definition(**self.task_definition())["taskDefinition"]
        arns: list[str] = []
        for rank in range(self.nnodes):
            resp = ecs.run_task(**self.run_task_request(td["taskDefinitionArn"], rank, cluster))
            if resp.get("failures") or not resp.get("tasks"):
                self.stop(ecs, arns, cluster, f"node {rank} could not be placed")
                reasons = sorted({f.get("reason", "?") for f in resp.get("failures") or []})
                raise JobError(
                    f"kiln job {self.job_id}: node {rank} of {self.nnodes} could not be placed "
                    f"({', '.join(reasons) or 'no task returned'}); every node needs its own "
                    "instance (distinctInstance) with the requested devices, CPU and memory"
                )
            arns.append(resp["tasks"][0]["taskArn"])
        return arns

    def stop(self, ecs: Any, arns: list[str], cluster: str = "default", reason: str = "") -> None:
        for arn in arns:
            ecs.stop_task(cluster=cluster, task=arn, reason=f"kiln job {self.job_id}: {reason}")

    def wait(
        self, ecs: Any, arns: list[str], cluster: str = "default", timeout: float = 600.0
    ) -> dict[str, Any]:
        """Wait for every task to stop.  When one fails or is stopped (a non-zero exit), the
        others are stopped at once; when one finishes (exit code 0), the others get
        ``FINISH_GRACE_S`` to finish too (the ranks of a job end together but not at the same
        instant: a rank still tearing down was killed with exit code 143), then are stopped.
        Returns the tasks (DescribeTasks) and their exit codes; raises :class:`JobError` on
        timeout (after stopping the job)."""
        deadline = time.monotonic() + timeout
        stopping = False
        grace_end: float | None = None
        while True:
            tasks = describe(ecs, arns, cluster)
            stopped = [t for t in tasks if t["lastStatus"] == "STOPPED"]
            if len(stopped) == len(tasks):
                codes = [t["containers"][0].get("exitCode") for t in tasks]
                return {"tasks": tasks, "exitCodes": codes}
            if stopped and not stopping:
                # failed, or stopped by StopTask (whatever its exit code): stop the rest now
                failed = [
                    t for t in stopped if _exit(t) != 0 or t.get("stopCode") == "UserInitiated"
                ]
                first = failed[0] if failed else stopped[0]
                why = first.get("stoppedReason") or f"exit code {_exit(first)}"
                if not failed and grace_end is None:
                    grace_end = time.monotonic() + FINISH_GRACE_S
                if failed or time.monotonic() > grace_end:
                    if not failed:
                        why += f"; the others did not finish within {FINISH_GRACE_S:.0f} s"
                    rest = [t["taskArn"] for t in tasks if t["lastStatus"] != "STOPPED"]
                    self.stop(ecs, rest, cluster, f"task {first['taskArn']} stopped ({why})")
                    stopping = True
            if time.monotonic() > deadline:
                self.stop(ecs, arns, cluster, "timed out")
                raise JobError(f"kiln job {self.job_id} did not finish within {timeout:.0f} s")
            time.sleep(0.5)


def describe(ecs: Any, arns: list[str], cluster: str = "default") -> list[dict[str, Any]]:
    by_arn = {t["taskArn"]: t for t in ecs.describe_tasks(cluster=cluster, tasks=arns)["tasks"]}
    missing = [a for a in arns if a not in by_arn]
    if missing:
        raise JobError(f"tasks not found: {', '.join(missing)}")
    return [by_arn[a] for a in arns]


def _exit(task: dict[str, Any]) -> Any:
    return task["containers"][0].get("exitCode")
