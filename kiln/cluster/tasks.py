"""Task actions (RunTask, DescribeTasks, ListTasks, StopTask) and the agent's lifecycle writes.

A task's devices are recorded in the ``devices`` table (``task_arn``) in the same exclusive
transaction that inserts the task, and released in the same transaction that marks it STOPPED,
so ``registered - sum(active tasks) == remaining`` holds after every commit.

Lifecycle: PROVISIONING (placed) -> PENDING (claimed by its agent, about to start) -> RUNNING
(process started, pid recorded) -> STOPPED (exit code / stop reason, devices freed).  StopTask sets
``desiredStatus`` STOPPED; a task no agent has claimed yet is stopped at once.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.cluster import invariants, placement, resources
from kiln.cluster.errors import ClientException, InvalidParameterException, ServerException
from kiln.cluster.paging import paginate as _paginate
from kiln.cluster.store import Tx, dumps, loads

if TYPE_CHECKING:
    from kiln.cluster.store import Store

ACTIVE_SQL = "last_status != 'STOPPED'"
LAUNCH_TYPE = placement.LAUNCH_TYPE


MAX_AMOUNT = 2**31 - 1  # the service's Integer fields


def _int(value: Any, default: int = 0, where: str = "amount") -> int:
    """A non-negative whole amount from an int or a string of digits; anything else is refused."""
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise InvalidParameterException(f"{where}: expected a whole number, got {value!r}")
    if isinstance(value, str):
        if not value.strip().isdigit() or not value.strip().isascii():
            raise InvalidParameterException(
                f"{where}: expected a whole number such as '1024', got {value!r}"
            )
        value = int(value.strip())
    if not isinstance(value, int) or not 0 <= value <= MAX_AMOUNT:
        raise InvalidParameterException(
            f"{where}: must be a whole number from 0 to {MAX_AMOUNT}, got {value!r}"
        )
    return value


def _container_request(container: dict[str, Any]) -> dict[str, Any]:
    from kiln.cluster import taskdef

    return taskdef.container_device_request(container)


def _store_full(e: BaseException) -> bool:
    """Whether ``e`` is the database refusing a write for lack of space."""
    text = str(e).lower()
    return "disk is full" in text or "no space left" in text or "disk full" in text


class TaskActions:
    """Mixed into ``ClusterService`` (which provides ``store``, ``arn``, ``cluster_name`` ...)."""

    store: Store
    rng: random.Random | None = None
    # Called with (task ARN, reason) when StopTask cannot be recorded (agents in this process).
    stop_hooks: list[Callable[[str, str], None]]

    # -- placement ----------------------------------------------------------------------------
    def candidates(
        self, tx: Tx, cluster: str, statuses: tuple[str, ...] | None = ("ACTIVE",)
    ) -> list[placement.Candidate]:
        """Snapshot every container instance of ``cluster`` for placement (or filtering)."""
        rows = tx.execute(
            "SELECT * FROM container_instances WHERE cluster = ? AND status != 'DEREGISTERED'"
            " ORDER BY registered_at, arn",
            (cluster,),
        )
        if statuses is not None:
            rows = [r for r in rows if r["status"] in statuses]
        out = []
        for r in rows:
            active = tx.execute(
                "SELECT grp, cpu, memory, last_status, taskdef_arn FROM tasks"
                f" WHERE instance_arn = ? AND {ACTIVE_SQL}",
                (r["arn"],),
            )
            devices = tx.execute(
                "SELECT * FROM devices WHERE instance_arn = ? ORDER BY kind, idx", (r["arn"],)
            )
            groups: dict[str, int] = {}
            for t in active:
                groups[t["grp"]] = groups.get(t["grp"], 0) + 1
            out.append(
                placement.Candidate(
                    arn=r["arn"],
                    ec2_instance_id=r["ec2_instance_id"],
                    status=r["status"],
                    agent_connected=self.agent_alive(r),
                    agent_version=r["agent_version"],
                    attributes=loads(r["attributes"]) or {},
                    registered_at=r["registered_at"],
                    remaining_cpu=r["cpu"] - sum(t["cpu"] for t in active),
                    remaining_memory=r["memory"] - sum(t["memory"] for t in active),
                    free_devices=[d for d in devices if d["task_arn"] is None],
                    all_devices=devices,
                    running_tasks_count=sum(1 for t in active if t["last_status"] == "RUNNING"),
                    groups=groups,
                    used_ports=self._used_ports(tx, active),
                )
            )
        return out

    @staticmethod
    def _used_ports(tx: Tx, active: list[dict[str, Any]]) -> set[tuple[int, str]]:
        """The fixed host ports the ``active`` tasks' task definitions hold."""
        used: set[tuple[int, str]] = set()
        for td_arn in {t["taskdef_arn"] for t in active}:
            row = tx.one("SELECT body FROM task_definitions WHERE arn = ?", (td_arn,))
            if row is not None:
                used.update(placement.host_ports(loads(row["body"])))
        return used

    def run_task(self, body: dict[str, Any]) -> dict[str, Any]:
        from kiln.cluster import query

        count = _int(body.get("count"), 1, "count")
        if not 1 <= count <= 10:
            raise InvalidParameterException("count must be between 1 and 10")
        constraints = list(body.get("placementConstraints") or [])
        strategies = placement.validate_strategies(list(body.get("placementStrategy") or []))
        query.validate_constraints(constraints, for_task_definition=False)
        placement.check_launch_type(body)
        self._check_tags(list(body.get("tags") or []))  # type: ignore[attr-defined]
        if body.get("propagateTags") == "SERVICE":
            raise InvalidParameterException(
                "propagateTags SERVICE applies to a service's tasks; RunTask takes"
                " TASK_DEFINITION or NONE"
            )
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            td_row = self.resolve_taskdef(tx, body.get("taskDefinition", ""))  # type: ignore[attr-defined]
            if td_row["status"] != "ACTIVE":
                raise ClientException("TaskDefinition is inactive")
            td = loads(td_row["body"])
            all_constraints = list(td.get("placementConstraints") or []) + constraints
            if len(all_constraints) > 10:
                raise InvalidParameterException("at most 10 placement constraints per task")
            containers = self._containers(td, body.get("overrides") or {})
            overrides = body.get("overrides") or {}
            needs = placement.TaskNeeds(
                cpu=_int(overrides.get("cpu"), _int(td.get("cpu"), 0), "overrides.cpu")
                or sum(c["cpu"] for c in containers),
                memory=_int(overrides.get("memory"), _int(td.get("memory"), 0), "overrides.memory")
                or sum(c["memory"] for c in containers),
                group=body.get("group") or f"family:{td['family']}",
                containers=[c["request"] for c in containers],
                constraints=all_constraints,
                strategies=strategies,
                host_ports=placement.host_ports(td),
            )
            token = body.get("clientToken")
            request = dumps({k: v for k, v in body.items() if k != "clientToken"})
            if token:
                seen = tx.one(
                    "SELECT request, response FROM client_tokens WHERE cluster = ? AND token = ?",
                    (cluster, token),
                )
                if seen is not None:
                    if seen["request"] != request:
                        raise InvalidParameterException(
                            "clientToken was already used for a different RunTask request"
                        )
                    done = loads(seen["response"])
                    return {
                        "tasks": [self.task_json(tx, a, tags=True) for a in done["taskArns"]],
                        "failures": done["failures"],
                    }
            cands = self.candidates(tx, cluster, statuses=("ACTIVE", "DRAINING"))
            if not cands:
                raise InvalidParameterException(
                    "No Container Instances were found in your cluster."
                )
            placed, failures = placement.place(cands, needs, count, self.rng)
            tasks = [
                self._insert_task(tx, cluster, td_row, body, needs, containers, p) for p in placed
            ]
            tags = self._run_tags(tx, td_row, body)
            for task in tasks:
                self._set_tags(tx, task["taskArn"], tags)  # type: ignore[attr-defined]
                task["tags"] = self._tags(tx, task["taskArn"])  # type: ignore[attr-defined]
            for arn in sorted({p.candidate.arn for p in placed}):
                invariants.check_instance(tx, arn)
            if token:
                tx.execute(
                    "INSERT INTO client_tokens (cluster, token, request, response, created_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (
                        cluster,
                        token,
                        request,
                        dumps({"taskArns": [t["taskArn"] for t in tasks], "failures": failures}),
                        time.time(),
                    ),
                )
        return {"tasks": tasks, "failures": failures}

    def _run_tags(
        self, tx: Tx, td_row: dict[str, Any], body: dict[str, Any]
    ) -> list[dict[str, str]]:
        """The tags RunTask gives each task: the task definition's when ``propagateTags`` is
        TASK_DEFINITION, then the request's ``tags`` (which win on a shared key)."""
        tags: list[dict[str, str]] = []
        if body.get("propagateTags") == "TASK_DEFINITION":
            tags += self._tags(tx, td_row["arn"])  # type: ignore[attr-defined]
        return tags + list(body.get("tags") or [])

    @staticmethod
    def _containers(td: dict[str, Any], overrides: dict[str, Any]) -> list[dict[str, Any]]:
        """The task's containers with ``overrides`` applied (command, environment, cpu, memory,
        resourceRequirements: placement reserves the overridden GPUs/Neuron devices).

        An override naming no container of the task definition, or naming one twice, is
        InvalidParameterException; nothing in an override is ignored silently.
        """
        from kiln.cluster import taskdef

        defs = list(td.get("containerDefinitions") or [])
        names = {c["name"] for c in defs}
        by_name: dict[str, dict[str, Any]] = {}
        for i, o in enumerate(overrides.get("containerOverrides") or []):
            name = o.get("name")
            if name not in names:
                raise InvalidParameterException(
                    f"overrides.containerOverrides[{i}]: Override for container named {name} is"
                    f" not a container in the TaskDefinition (containers: {sorted(names)})"
                )
            if name in by_name:
                raise InvalidParameterException(
                    f"overrides.containerOverrides[{i}]: a second override for container {name!r};"
                    " give each container at most one override"
                )
            by_name[name] = o
        requirements = {
            n: list(o["resourceRequirements"])
            for n, o in by_name.items()
            if o.get("resourceRequirements") is not None
        }
        if requirements:
            defs = taskdef.override_requirements(defs, requirements)
        out = []
        for c in defs:
            o = by_name.get(c.get("name"), {})
            env = {e["name"]: e.get("value", "") for e in c.get("environment") or []}
            env.update({e["name"]: e.get("value", "") for e in o.get("environment") or []})
            out.append(
                {
                    "name": c["name"],
                    "image": c.get("image"),
                    "command": list(c.get("entryPoint") or [])
                    + list(o.get("command") or c.get("command") or []),
                    "environment": env,
                    "cpu": _int(o.get("cpu"), _int(c.get("cpu")), "containerOverrides.cpu"),
                    "memory": _int(
                        o.get("memory"),
                        _int(c.get("memory"), _int(c.get("memoryReservation"))),
                        "containerOverrides.memory",
                    ),
                    "request": _container_request(c),
                    "hostDevices": [
                        d["hostPath"] for d in (c.get("linuxParameters") or {}).get("devices") or []
                    ],
                    "essential": bool(c.get("essential", True)),
                    "dependsOn": list(c.get("dependsOn") or []),
                    "stopTimeout": c.get("stopTimeout"),
                    "user": c.get("user"),
                    "workingDirectory": c.get("workingDirectory"),
                    "secrets": list(c.get("secrets") or []),
                }
            )
        return out

    def _insert_task(
        self,
        tx: Tx,
        cluster: str,
        td_row: dict[str, Any],
        body: dict[str, Any],
        needs: placement.TaskNeeds,
        containers: list[dict[str, Any]],
        p: placement.Placement,
    ) -> dict[str, Any]:
        task_id = secrets.token_hex(16)
        arn = self.arn("task", f"{cluster}/{task_id}")  # type: ignore[attr-defined]
        stored = []
        for c, devs in zip(containers, p.devices):
            for d in devs:
                tx.execute(
                    "UPDATE devices SET task_arn = ? WHERE instance_arn = ? AND device_id = ?"
                    " AND task_arn IS NULL",
                    (arn, p.candidate.arn, d["device_id"]),
                )
                if tx.rowcount != 1:  # cannot happen under the exclusive lock; never double-book
                    raise RuntimeError(f"device {d['device_id']} was taken concurrently")
            stored.append(
                {
                    "name": c["name"],
                    "containerArn": self.arn(  # type: ignore[attr-defined]
                        "container", f"{cluster}/{task_id}/{secrets.token_hex(16)}"
                    ),
                    "command": c["command"],
                    "environment": c["environment"],
                    "cpu": c["cpu"],
                    "memory": c["memory"],
                    "hostDevices": c["hostDevices"],
                    **{
                        k: c[k]
                        for k in (
                            "image",
                            "essential",
                            "dependsOn",
                            "stopTimeout",
                            "user",
                            "workingDirectory",
                            "secrets",
                        )
                    },
                    "devices": [
                        {
                            k: d[k]
                            for k in (
                                "device_id",
                                "kind",
                                "idx",
                                "path",
                                "cores",
                                "uuid",
                                "memory_mib",
                                "name",
                            )
                        }
                        for d in devs
                    ],
                    "lastStatus": "PENDING",
                }
            )
        tx.execute(
            "INSERT INTO tasks (arn, cluster, instance_arn, taskdef_arn, family, grp, started_by,"
            " last_status, desired_status, cpu, memory, containers, overrides, created_at, version)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 'PROVISIONING', 'RUNNING', ?, ?, ?, ?, ?, 1)",
            (
                arn,
                cluster,
                p.candidate.arn,
                td_row["arn"],
                td_row["family"],
                needs.group,
                body.get("startedBy"),
                needs.cpu,
                needs.memory,
                dumps(stored),
                dumps(body.get("overrides") or {}),
                time.time(),
            ),
        )
        return self.task_json(tx, arn)

    # -- describing ---------------------------------------------------------------------------
    def task_json(self, tx: Tx, arn: str, tags: bool = False) -> dict[str, Any]:
        """The task's ECS document; with ``tags``, its ``tags`` too (DescribeTasks' TAGS)."""
        t = tx.one("SELECT * FROM tasks WHERE arn = ?", (arn,))
        if t is None:
            raise InvalidParameterException("task not found")
        cluster_arn = self.arn("cluster", t["cluster"])  # type: ignore[attr-defined]
        containers = []
        for c in loads(t["containers"]):
            doc = {
                "containerArn": c["containerArn"],
                "taskArn": arn,
                "name": c["name"],
                "lastStatus": c.get("lastStatus", "PENDING"),
                "cpu": str(c["cpu"]),
                "gpuIds": [resources.public_id(d) for d in c["devices"] if d["kind"] == "gpu"],
                "neuronDeviceIds": [
                    resources.public_id(d) for d in c["devices"] if d["kind"] == "neuron"
                ],
            }
            if c.get("image"):
                doc["image"] = c["image"]
            if c.get("memory"):
                doc["memory"] = str(c["memory"])
            if c.get("exitCode") is not None:
                doc["exitCode"] = c["exitCode"]
            if c.get("reason"):
                doc["reason"] = c["reason"]
            containers.append(doc)
        doc = {
            "taskArn": arn,
            "clusterArn": cluster_arn,
            "taskDefinitionArn": t["taskdef_arn"],
            "containerInstanceArn": t["instance_arn"],
            "overrides": loads(t["overrides"]) or {},
            "lastStatus": t["last_status"],
            "desiredStatus": t["desired_status"],
            "cpu": str(t["cpu"]),
            "memory": str(t["memory"]),
            "containers": containers,
            "group": t["grp"],
            "launchType": LAUNCH_TYPE,
            "version": t["version"],
            "createdAt": t["created_at"],
        }
        for key, col in (
            ("startedBy", "started_by"),
            ("stoppedReason", "stopped_reason"),
            ("stopCode", "stop_code"),
            ("startedAt", "started_at"),
            ("stoppingAt", "stopping_at"),
            ("stoppedAt", "stopped_at"),
        ):
            if t[col] is not None:
                doc[key] = t[col]
        zone = self._availability_zone(tx, t["instance_arn"])
        if zone is not None:
            doc["availabilityZone"] = zone
        if tags:
            doc["tags"] = self._tags(tx, arn)  # type: ignore[attr-defined]
        return doc

    @staticmethod
    def _availability_zone(tx: Tx, instance_arn: str | None) -> str | None:
        """The ``ecs.availability-zone`` attribute of the task's instance, if it has one."""
        row = tx.one("SELECT attributes FROM container_instances WHERE arn = ?", (instance_arn,))
        zone = (loads(row["attributes"]) or {}).get("ecs.availability-zone") if row else None
        return zone if isinstance(zone, str) and zone else None

    def _task_arn(self, cluster: str, ref: str) -> str:
        return ref if ref.startswith("arn:") else self.arn("task", f"{cluster}/{ref}")  # type: ignore[attr-defined]

    def describe_tasks(self, body: dict[str, Any]) -> dict[str, Any]:
        """DescribeTasks; each task carries its ``tags`` when ``include`` has "TAGS"."""
        found, failures = [], []
        with_tags = "TAGS" in (body.get("include") or [])
        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            for ref in body.get("tasks") or []:
                arn = self._task_arn(cluster, ref)
                if (
                    tx.one("SELECT arn FROM tasks WHERE arn = ? AND cluster = ?", (arn, cluster))
                    is None
                ):
                    failures.append({"arn": ref, "reason": "MISSING"})
                else:
                    found.append(self.task_json(tx, arn, tags=with_tags))
        return {"tasks": found, "failures": failures}

    def list_tasks(self, body: dict[str, Any]) -> dict[str, Any]:
        """ListTasks: every filter given narrows the list (they combine with AND).

        ``serviceName`` keeps only that service's tasks (``startedBy=ecs-svc/<name>``; an unknown
        service is ServiceNotFoundException); ``launchType`` other than EC2 matches no task.
        """
        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            if body.get("serviceName"):
                service = self._service_row(tx, cluster, body["serviceName"])  # type: ignore[attr-defined]
            if body.get("launchType") not in (None, LAUNCH_TYPE):
                return _paginate([], body, "taskArns")
            sql, params = "SELECT arn FROM tasks WHERE cluster = ?", [cluster]
            desired = body.get("desiredStatus") or "RUNNING"
            sql += " AND desired_status = ?"
            params.append(desired)
            if body.get("containerInstance"):
                ref = body["containerInstance"]
                sql += " AND instance_arn = ?"
                params.append(
                    ref
                    if ref.startswith("arn:")
                    else self.arn("container-instance", f"{cluster}/{ref}")  # type: ignore[attr-defined]
                )
            if body.get("family"):
                sql += " AND family = ?"
                params.append(body["family"])
            if body.get("startedBy"):
                sql += " AND started_by = ?"
                params.append(body["startedBy"])
            if body.get("serviceName"):
                sql += " AND started_by = ?"
                params.append("ecs-svc/" + service["name"])
            arns = [r["arn"] for r in tx.execute(sql + " ORDER BY created_at, arn", params)]
        return _paginate(arns, body, "taskArns")

    def stop_task(self, body: dict[str, Any]) -> dict[str, Any]:
        """StopTask; if the store cannot take the write (disk full), the agents in this process
        are still told to stop the task's processes, and the caller gets a ServerException."""
        try:
            return self._stop_task(body)
        except Exception as e:
            if not _store_full(e):
                raise
            reason = body.get("reason") or "Task stopped by user"
            with self.store.transaction() as tx:
                cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            arn = self._task_arn(cluster, body.get("task") or "")
            for hook in self.stop_hooks:
                hook(arn, reason)
            raise ServerException(
                f"the store is full ({e}); the stop is not recorded, but this server's agent"
                " was told to stop the task's processes. Free disk space and call StopTask again."
            ) from e

    def _stop_task(self, body: dict[str, Any]) -> dict[str, Any]:
        reason = body.get("reason") or "Task stopped by user"
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            arn = self._task_arn(cluster, body.get("task") or "")
            t = tx.one("SELECT * FROM tasks WHERE arn = ? AND cluster = ?", (arn, cluster))
            if t is None:
                raise InvalidParameterException("The referenced task was not found.")
            self._request_stop(tx, t, reason)
            return {"task": self.task_json(tx, arn)}

    def _request_stop(self, tx: Tx, t: dict[str, Any], reason: str) -> None:
        """Ask for task row ``t`` to stop (``UserInitiated``): a task no agent has claimed
        (PROVISIONING) is STOPPED at once; a claimed one gets ``desiredStatus`` STOPPED and its
        agent ends its processes, then records STOPPED.  Idempotent."""
        if t["last_status"] == "PROVISIONING":  # no agent owns it yet: stop it here
            self._stop_in_tx(tx, t["arn"], None, reason, "UserInitiated")
        elif t["last_status"] != "STOPPED" and t["desired_status"] != "STOPPED":
            tx.execute(
                "UPDATE tasks SET desired_status = 'STOPPED', stopped_reason = ?,"
                " stop_code = 'UserInitiated', stopping_at = ?, version = version + 1"
                " WHERE arn = ?",
                (reason, time.time(), t["arn"]),
            )

    # -- agent lifecycle ----------------------------------------------------------------------
    def agent_tasks(self, instance_arn: str) -> list[dict[str, Any]]:
        """Active task rows of one instance (for its agent)."""
        rows = self.store.query(
            f"SELECT * FROM tasks WHERE instance_arn = ? AND {ACTIVE_SQL} ORDER BY created_at",
            (instance_arn,),
        )
        for r in rows:
            r["containers"] = loads(r["containers"])
        return rows

    def claim_task(self, arn: str, work_dir: str) -> bool:
        """PROVISIONING -> PENDING: the agent takes ownership before launching anything."""
        with self.store.transaction(exclusive=True) as tx:
            tx.execute(
                "UPDATE tasks SET last_status = 'PENDING', work_dir = ?, version = version + 1"
                " WHERE arn = ? AND last_status = 'PROVISIONING' AND desired_status = 'RUNNING'",
                (work_dir, arn),
            )
            return tx.rowcount == 1

    def mark_running(self, arn: str, procs: list[tuple[int, float] | None]) -> None:
        """Record each started container's pid and psutil create time (for safe re-adoption).

        ``procs`` has one entry per container; None for one not started yet (``dependsOn``).
        """
        with self.store.transaction(exclusive=True) as tx:
            t = tx.one("SELECT containers, started_at FROM tasks WHERE arn = ?", (arn,))
            if t is None:
                return
            containers = loads(t["containers"])
            for c, proc in zip(containers, procs):
                if proc is not None and c.get("lastStatus") != "STOPPED":  # exited stays so
                    c.update(lastStatus="RUNNING", pid=proc[0], pidStart=proc[1])
            first = next((p for p in procs if p is not None), None)
            tx.execute(
                "UPDATE tasks SET last_status = 'RUNNING', pid = ?, pid_start = ?,"
                " started_at = ?, containers = ?, version = version + 1"
                " WHERE arn = ? AND last_status != 'STOPPED'",
                (
                    first[0] if first else None,
                    first[1] if first else None,
                    t["started_at"] or time.time(),
                    dumps(containers),
                    arn,
                ),
            )

    def mark_containers_exited(self, arn: str, codes: dict[int, int | None]) -> None:
        """Record containers (by index) that exited on their own while their task goes on: each
        is STOPPED with its exit code and no ``reason`` (nothing stopped it).  A STOPPED task is
        left as it is."""
        with self.store.transaction(exclusive=True) as tx:
            t = tx.one("SELECT containers, last_status FROM tasks WHERE arn = ?", (arn,))
            if t is None or t["last_status"] == "STOPPED":
                return
            containers = loads(t["containers"])
            for i, code in codes.items():
                if 0 <= i < len(containers) and containers[i].get("lastStatus") != "STOPPED":
                    containers[i].update(lastStatus="STOPPED", exitCode=code)
            tx.execute(
                "UPDATE tasks SET containers = ?, version = version + 1 WHERE arn = ?",
                (dumps(containers), arn),
            )

    agent_timeout_s: float = 60.0

    def agent_alive(self, row: dict[str, Any]) -> bool:
        """``agentConnected``: set, and a heartbeat within ``agent_timeout_s``."""
        beat = row.get("heartbeat_at") or 0.0
        return bool(row["agent_connected"]) and beat >= time.time() - self.agent_timeout_s

    def reap_disconnected(self) -> list[str]:
        """Stop tasks placed on an instance whose agent went quiet before claiming them.

        Only PROVISIONING tasks: no process of theirs can exist, so freeing their devices is
        safe; a claimed (PENDING/RUNNING) task keeps its devices until its agent reports back.
        """
        cutoff = time.time() - self.agent_timeout_s
        stopped = []
        with self.store.transaction(exclusive=True) as tx:
            rows = tx.execute(
                "SELECT t.arn FROM tasks t JOIN container_instances i ON t.instance_arn = i.arn"
                " WHERE t.last_status = 'PROVISIONING' AND t.created_at < ?"
                " AND (i.agent_connected = 0 OR COALESCE(i.heartbeat_at, 0) < ?)",
                (cutoff, cutoff),
            )
            for r in rows:
                self._stop_in_tx(
                    tx,
                    r["arn"],
                    None,
                    "Task stopped: the container instance's agent is disconnected",
                    "TaskFailedToStart",
                )
                stopped.append(r["arn"])
        return stopped

    def heartbeat(self, instance_arn: str) -> None:
        """The agent of ``instance_arn`` is alive (``agentConnected`` true until it goes quiet)."""
        with self.store.transaction(exclusive=True) as tx:
            tx.execute(
                "UPDATE container_instances SET heartbeat_at = ?, agent_connected = 1"
                " WHERE arn = ? AND status != 'DEREGISTERED'",
                (time.time(), instance_arn),
            )

    def mark_stopped(
        self,
        arn: str,
        exit_code: int | None | list[int | None],
        reason: str,
        stop_code: str = "EssentialContainerExited",
    ) -> None:
        """Mark a task STOPPED and free its devices, in one transaction (idempotent)."""
        with self.store.transaction(exclusive=True) as tx:
            self._stop_in_tx(tx, arn, exit_code, reason, stop_code)

    def _stop_in_tx(
        self,
        tx: Tx,
        arn: str,
        exit_code: int | None | list[int | None],
        reason: str,
        stop_code: str,
    ) -> None:
        t = tx.one("SELECT * FROM tasks WHERE arn = ?", (arn,))
        if t is None or t["last_status"] == "STOPPED":
            tx.execute("UPDATE devices SET task_arn = NULL WHERE task_arn = ?", (arn,))
            if t is not None:
                invariants.check_instance(tx, t["instance_arn"])
            return
        containers = loads(t["containers"])
        codes = exit_code if isinstance(exit_code, list) else [exit_code] * len(containers)
        codes = codes + [None] * (len(containers) - len(codes))
        for c, code in zip(containers, codes):
            if c.get("lastStatus") == "STOPPED":  # exited on its own: keeps its code, no reason
                if c.get("exitCode") is None:
                    c["exitCode"] = code
                continue
            c.update(lastStatus="STOPPED", exitCode=code, reason=reason)
        exit_code = next((c for c in codes if c is not None), None)
        now = time.time()
        tx.execute(
            "UPDATE tasks SET last_status = 'STOPPED', desired_status = 'STOPPED', exit_code = ?,"
            " stopped_reason = ?, stop_code = ?, stopping_at = COALESCE(stopping_at, ?),"
            " stopped_at = ?, containers = ?, version = version + 1 WHERE arn = ?",
            (
                exit_code,
                t["stopped_reason"] or reason,
                t["stop_code"] or stop_code,
                now,
                now,
                dumps(containers),
                arn,
            ),
        )
        tx.execute("UPDATE devices SET task_arn = NULL WHERE task_arn = ?", (arn,))
        invariants.check_instance(tx, t["instance_arn"])
