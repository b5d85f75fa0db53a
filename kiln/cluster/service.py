"""The cluster API: the container service's actions as Python methods over a ``Store``.

``ClusterService.call("RunTask", body)`` takes and returns the same JSON documents as the ECS
JSON protocol (the HTTP server is a thin shell around it).  Task-definition, cluster and
container-instance actions live here; task actions (RunTask, DescribeTasks, StopTask, ...) and the
agent's lifecycle writes live in ``kiln.cluster.tasks`` and are mixed in.
"""

from __future__ import annotations

import random
import re
import secrets
import time
from typing import Any

from kiln.cluster import invariants, placement, resources, validate
from kiln.cluster.ecs_services import ServiceActions
from kiln.cluster.errors import (
    ClientException,
    ClusterNotFoundException,
    InvalidParameterException,
    UnknownOperationException,
)
from kiln.cluster.paging import paginate as _paginate
from kiln.cluster.store import Store, Tx, dumps, loads
from kiln.cluster.tasks import TaskActions

AGENT_VERSION = "kiln-1.0"

# Action name -> method name, for the actions the server exposes.
ACTIONS = {
    "RegisterTaskDefinition": "register_task_definition",
    "DescribeTaskDefinition": "describe_task_definition",
    "ListTaskDefinitions": "list_task_definitions",
    "ListTaskDefinitionFamilies": "list_task_definition_families",
    "DeregisterTaskDefinition": "deregister_task_definition",
    "CreateCluster": "create_cluster",
    "DescribeClusters": "describe_clusters",
    "ListClusters": "list_clusters",
    "RegisterContainerInstance": "register_container_instance",
    "DeregisterContainerInstance": "deregister_container_instance",
    "DescribeContainerInstances": "describe_container_instances",
    "ListContainerInstances": "list_container_instances",
    "UpdateContainerInstancesState": "update_container_instances_state",
    "RunTask": "run_task",
    "DescribeTasks": "describe_tasks",
    "ListTasks": "list_tasks",
    "StopTask": "stop_task",
    "CreateService": "create_service",
    "UpdateService": "update_service",
    "DeleteService": "delete_service",
    "DescribeServices": "describe_services",
    "ListServices": "list_services",
    "TagResource": "tag_resource",
    "UntagResource": "untag_resource",
    "ListTagsForResource": "list_tags_for_resource",
}


class ClusterService(TaskActions, ServiceActions):
    """All API actions; one instance may be shared by many threads."""

    def __init__(
        self,
        store: Store,
        region: str = "us-east-1",
        account: str = "000000000000",
        seed: int | None = None,
        agent_timeout_s: float = 60.0,
    ) -> None:
        self.agent_timeout_s = agent_timeout_s
        self.store = store
        self.rng = random.Random(seed) if seed is not None else None
        self.stop_hooks = []
        self.region = region
        self.account = account

    # -- plumbing -----------------------------------------------------------------------------
    def call(self, action: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """Dispatch one API action by its ECS name."""
        method = ACTIONS.get(action)
        if method is None:
            raise UnknownOperationException(f"Kiln does not implement the action {action!r}")
        body = validate.validate_request(action, {} if body is None else body)
        return getattr(self, method)(body)

    def arn(self, kind: str, rest: str) -> str:
        return f"arn:aws:ecs:{self.region}:{self.account}:{kind}/{rest}"

    @staticmethod
    def _name_from(ref: str, kind: str) -> str:
        """``name`` from either a name or an ARN of ``kind``."""
        if ref.startswith("arn:"):
            tail = ref.split(":", 5)[-1]
            if not tail.startswith(kind + "/"):
                raise InvalidParameterException(f"{ref!r} is not a {kind} ARN")
            return tail[len(kind) + 1 :]
        return ref

    def cluster_name(self, tx: Tx, ref: str | None, create: bool = False) -> str:
        """Resolve a cluster name or ARN; ClusterNotFoundException unless it exists."""
        name = self._name_from(ref or "default", "cluster")
        row = tx.one("SELECT status FROM clusters WHERE name = ?", (name,))
        if row is None and create:
            self._insert_cluster(tx, name)
            return name
        if row is None or row["status"] != "ACTIVE":
            raise ClusterNotFoundException("Cluster not found.")
        return name

    def _insert_cluster(self, tx: Tx, name: str) -> None:
        tx.execute(
            "INSERT INTO clusters (name, arn, status, created_at) VALUES (?, ?, 'ACTIVE', ?)",
            (name, self.arn("cluster", name), time.time()),
        )

    # -- task definitions ---------------------------------------------------------------------
    def register_task_definition(self, body: dict[str, Any]) -> dict[str, Any]:
        from kiln.cluster import taskdef

        normalized = taskdef.validate_task_definition(body)
        family = normalized["family"]
        with self.store.transaction(exclusive=True) as tx:
            row = tx.one(
                "SELECT MAX(revision) AS rev FROM task_definitions WHERE family = ?", (family,)
            )
            revision = int(row["rev"] or 0) + 1 if row else 1
            arn = self.arn("task-definition", f"{family}:{revision}")
            tx.execute(
                "INSERT INTO task_definitions (family, revision, arn, status, body, registered_at)"
                " VALUES (?, ?, ?, 'ACTIVE', ?, ?)",
                (family, revision, arn, dumps(normalized), time.time()),
            )
            self._set_tags(tx, arn, body.get("tags") or [])
            td = self._taskdef_row(tx, family, revision)
            return {"taskDefinition": td, "tags": self._tags(tx, arn)}

    def _taskdef_row(self, tx: Tx, family: str, revision: int) -> dict[str, Any]:
        row = tx.one(
            "SELECT * FROM task_definitions WHERE family = ? AND revision = ?", (family, revision)
        )
        assert row is not None
        return self._taskdef_json(row)

    @staticmethod
    def _taskdef_json(row: dict[str, Any]) -> dict[str, Any]:
        td = dict(loads(row["body"]))
        td.pop("tags", None)
        td.update(
            compatibilities=[placement.LAUNCH_TYPE],  # the one launch type it is valid for
            taskDefinitionArn=row["arn"],
            revision=row["revision"],
            status=row["status"],
            registeredAt=row["registered_at"],
        )
        if row["deregistered_at"]:
            td["deregisteredAt"] = row["deregistered_at"]
        return td

    def resolve_taskdef(self, tx: Tx, ref: str) -> dict[str, Any]:
        """The stored row for ``family``, ``family:revision`` or a task-definition ARN."""
        if not ref:
            raise ClientException("taskDefinition is required")
        name = self._name_from(ref, "task-definition")
        match = re.fullmatch(r"(.+):(\d+)", name)
        if match:
            row = tx.one(
                "SELECT * FROM task_definitions WHERE family = ? AND revision = ?",
                (match.group(1), int(match.group(2))),
            )
        else:
            row = tx.one(
                "SELECT * FROM task_definitions WHERE family = ? AND status = 'ACTIVE'"
                " ORDER BY revision DESC LIMIT 1",
                (name,),
            )
        if row is None:
            raise ClientException("Unable to describe task definition.")
        return row

    def describe_task_definition(self, body: dict[str, Any]) -> dict[str, Any]:
        """DescribeTaskDefinition; ``tags`` (stored at registration or by TagResource) are in the
        reply only when ``include`` has "TAGS", as in ECS."""
        with self.store.transaction() as tx:
            row = self.resolve_taskdef(tx, body.get("taskDefinition", ""))
            reply: dict[str, Any] = {"taskDefinition": self._taskdef_json(row)}
            if "TAGS" in (body.get("include") or []):
                reply["tags"] = self._tags(tx, row["arn"])
        return reply

    def list_task_definitions(self, body: dict[str, Any]) -> dict[str, Any]:
        """Revisions with ``status`` (default ACTIVE); ``familyPrefix`` is, as in the service,
        the *whole* family name: ``train`` never lists ``train-eval``."""
        status = body.get("status") or "ACTIVE"
        order = "DESC" if body.get("sort") == "DESC" else "ASC"
        rows = self.store.query(
            f"SELECT arn, family FROM task_definitions WHERE status = ?"
            f" ORDER BY family {order}, revision {order}",
            (status,),
        )
        family = body.get("familyPrefix")
        arns = [r["arn"] for r in rows if not family or r["family"] == family]
        return _paginate(arns, body, "taskDefinitionArns")

    def list_task_definition_families(self, body: dict[str, Any]) -> dict[str, Any]:
        """Family names starting with ``familyPrefix`` (a true prefix here), filtered by
        ``status``: ACTIVE = at least one ACTIVE revision, INACTIVE = no ACTIVE revision,
        ALL (the default, as in the service) = every family."""
        rows = self.store.query(
            "SELECT family, MAX(CASE WHEN status = 'ACTIVE' THEN 1 ELSE 0 END) AS active"
            " FROM task_definitions GROUP BY family ORDER BY family"
        )
        status = body.get("status") or "ALL"
        prefix = body.get("familyPrefix") or ""
        fams = [
            r["family"]
            for r in rows
            if r["family"].startswith(prefix)
            and (status == "ALL" or (status == "ACTIVE") == bool(r["active"]))
        ]
        return _paginate(fams, body, "families")

    def deregister_task_definition(self, body: dict[str, Any]) -> dict[str, Any]:
        ref = body.get("taskDefinition", "")
        if not re.search(r":\d+$", ref):
            raise ClientException("The specified task definition must include a revision.")
        with self.store.transaction(exclusive=True) as tx:
            row = self.resolve_taskdef(tx, ref)
            tx.execute(
                "UPDATE task_definitions SET status = 'INACTIVE', deregistered_at = ?"
                " WHERE arn = ?",
                (time.time(), row["arn"]),
            )
            td = self._taskdef_row(tx, row["family"], row["revision"])
        return {"taskDefinition": td}

    # -- clusters -----------------------------------------------------------------------------
    def create_cluster(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("clusterName") or "default"
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", name):
            raise InvalidParameterException(
                "Cluster names may contain up to 255 letters, numbers, hyphens and underscores."
            )
        with self.store.transaction(exclusive=True) as tx:
            row = tx.one("SELECT status FROM clusters WHERE name = ?", (name,))
            if row is None:
                self._insert_cluster(tx, name)
            elif row["status"] != "ACTIVE":
                tx.execute("UPDATE clusters SET status = 'ACTIVE' WHERE name = ?", (name,))
            self._set_tags(tx, self.arn("cluster", name), body.get("tags") or [])
            return {"cluster": self._cluster_json(tx, name)}

    def _cluster_json(self, tx: Tx, name: str) -> dict[str, Any]:
        row = tx.one("SELECT * FROM clusters WHERE name = ?", (name,))
        assert row is not None
        inst = tx.one(
            "SELECT COUNT(*) AS n FROM container_instances WHERE cluster = ?"
            " AND status IN ('ACTIVE', 'DRAINING')",
            (name,),
        )
        counts = {
            r["last_status"]: r["n"]
            for r in tx.execute(
                "SELECT last_status, COUNT(*) AS n FROM tasks WHERE cluster = ?"
                " AND last_status != 'STOPPED' GROUP BY last_status",
                (name,),
            )
        }
        return {
            "clusterArn": row["arn"],
            "clusterName": name,
            "status": row["status"],
            "registeredContainerInstancesCount": inst["n"] if inst else 0,
            "runningTasksCount": counts.get("RUNNING", 0),
            "pendingTasksCount": sum(n for s, n in counts.items() if s != "RUNNING"),
            "activeServicesCount": (
                tx.one(
                    "SELECT COUNT(*) AS n FROM services WHERE cluster = ? AND status = 'ACTIVE'",
                    (name,),
                )
                or {"n": 0}
            )["n"],
        }

    def describe_clusters(self, body: dict[str, Any]) -> dict[str, Any]:
        refs = body.get("clusters") or ["default"]
        clusters, failures = [], []
        with self.store.transaction() as tx:
            for ref in refs:
                name = self._name_from(ref, "cluster")
                if tx.one("SELECT name FROM clusters WHERE name = ?", (name,)) is None:
                    failures.append({"arn": self.arn("cluster", name), "reason": "MISSING"})
                else:
                    clusters.append(self._cluster_json(tx, name))
        return {"clusters": clusters, "failures": failures}

    def list_clusters(self, body: dict[str, Any]) -> dict[str, Any]:
        rows = self.store.query("SELECT arn FROM clusters WHERE status = 'ACTIVE' ORDER BY name")
        return _paginate([r["arn"] for r in rows], body, "clusterArns")

    # -- container instances ------------------------------------------------------------------
    def register_container_instance(self, body: dict[str, Any]) -> dict[str, Any]:
        spec = resources.instance_spec(body)
        now = time.time()
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"), create=True)
            arn = body.get("containerInstanceArn")
            if arn:
                row = tx.one("SELECT * FROM container_instances WHERE arn = ?", (arn,))
                if row is None:
                    raise InvalidParameterException("Container instance not found.")
                busy = tx.one(
                    "SELECT COUNT(*) AS n FROM devices WHERE instance_arn = ?"
                    " AND task_arn IS NOT NULL",
                    (arn,),
                )
                if busy and busy["n"]:
                    raise ClientException(
                        "cannot re-register a container instance while tasks hold its devices"
                    )
                tx.execute("DELETE FROM container_instances WHERE arn = ?", (arn,))
                tx.execute("DELETE FROM devices WHERE instance_arn = ?", (arn,))
            else:
                arn = self.arn("container-instance", f"{cluster}/{secrets.token_hex(16)}")
            tx.execute(
                "INSERT INTO container_instances (arn, cluster, ec2_instance_id, instance_type,"
                " status, agent_connected, agent_version, attributes, cpu, memory, simulated,"
                " device_root, registered_at, heartbeat_at, version)"
                " VALUES (?, ?, ?, ?, 'ACTIVE', 1, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
                (
                    arn,
                    cluster,
                    spec.ec2_instance_id,
                    spec.instance_type,
                    spec.agent_version,
                    dumps(spec.attributes),
                    spec.cpu,
                    spec.memory,
                    int(spec.simulated),
                    spec.device_root,
                    now,
                    now,
                ),
            )
            for dev in spec.devices:
                tx.execute(
                    "INSERT INTO devices (instance_arn, device_id, kind, idx, path, cores,"
                    " memory_mib, name, uuid, task_arn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                    (
                        arn,
                        dev.device_id,
                        dev.kind,
                        dev.index,
                        dev.path,
                        dev.cores,
                        dev.memory_mib,
                        dev.name,
                        dev.uuid,
                    ),
                )
            invariants.check_instance(tx, arn)
            return {"containerInstance": self.instance_json(tx, arn)}

    def instance_json(self, tx: Tx, arn: str) -> dict[str, Any]:
        """A ContainerInstance document; remaining = registered - what active tasks hold."""
        row = tx.one("SELECT * FROM container_instances WHERE arn = ?", (arn,))
        if row is None:
            raise InvalidParameterException("Container instance not found.")
        used = tx.one(
            "SELECT COALESCE(SUM(cpu), 0) AS cpu, COALESCE(SUM(memory), 0) AS memory,"
            " COUNT(*) AS n, SUM(CASE WHEN last_status = 'RUNNING' THEN 1 ELSE 0 END) AS running"
            " FROM tasks WHERE instance_arn = ? AND last_status != 'STOPPED'",
            (arn,),
        ) or {"cpu": 0, "memory": 0, "n": 0, "running": 0}
        devices = tx.execute(
            "SELECT * FROM devices WHERE instance_arn = ? ORDER BY kind, idx", (arn,)
        )
        attrs = loads(row["attributes"]) or {}
        running = int(used["running"] or 0)
        return {
            "containerInstanceArn": arn,
            "ec2InstanceId": row["ec2_instance_id"],
            "version": row["version"],
            "versionInfo": {"agentVersion": row["agent_version"]},
            "registeredResources": resources.resource_list(row["cpu"], row["memory"], devices),
            "remainingResources": resources.resource_list(
                row["cpu"] - int(used["cpu"]),
                row["memory"] - int(used["memory"]),
                [d for d in devices if d["task_arn"] is None],
            ),
            "status": row["status"],
            "agentConnected": self.agent_alive(row),
            "runningTasksCount": running,
            "pendingTasksCount": int(used["n"]) - running,
            "attributes": [{"name": k, "value": v} for k, v in sorted(attrs.items())],
            "registeredAt": row["registered_at"],
        }

    def _instance_arns(self, tx: Tx, cluster: str, refs: list[str]) -> list[tuple[str, str]]:
        """(reference, arn or "") for each requested instance: ARN or bare id."""
        out = []
        for ref in refs:
            arn = (
                ref
                if ref.startswith("arn:")
                else self.arn("container-instance", f"{cluster}/{ref}")
            )
            row = tx.one(
                "SELECT arn FROM container_instances WHERE arn = ? AND cluster = ?", (arn, cluster)
            )
            out.append((ref, row["arn"] if row else ""))
        return out

    def describe_container_instances(self, body: dict[str, Any]) -> dict[str, Any]:
        found, failures = [], []
        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))
            for ref, arn in self._instance_arns(tx, cluster, body.get("containerInstances") or []):
                if arn:
                    found.append(self.instance_json(tx, arn))
                else:
                    failures.append({"arn": ref, "reason": "MISSING"})
        return {"containerInstances": found, "failures": failures}

    def list_container_instances(self, body: dict[str, Any]) -> dict[str, Any]:
        from kiln.cluster import query

        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))
            sql = "SELECT arn FROM container_instances WHERE cluster = ?"
            params: list[Any] = [cluster]
            if body.get("status"):
                sql += " AND status = ?"
                params.append(body["status"])
            else:
                sql += " AND status != 'DEREGISTERED'"
            arns = [r["arn"] for r in tx.execute(sql + " ORDER BY registered_at, arn", params)]
            if body.get("filter"):
                expr = query.parse(body["filter"])
                cands = {c.arn: c for c in self.candidates(tx, cluster, statuses=None)}
                arns = [a for a in arns if a in cands and expr.evaluate(cands[a].subject())]
        return _paginate(arns, body, "containerInstanceArns")

    def update_container_instances_state(self, body: dict[str, Any]) -> dict[str, Any]:
        status = body.get("status")
        if status not in ("ACTIVE", "DRAINING"):
            raise InvalidParameterException("status must be ACTIVE or DRAINING")
        found, failures = [], []
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))
            for ref, arn in self._instance_arns(tx, cluster, body.get("containerInstances") or []):
                if not arn:
                    failures.append({"arn": ref, "reason": "MISSING"})
                    continue
                tx.execute(
                    "UPDATE container_instances SET status = ?, version = version + 1"
                    " WHERE arn = ?",
                    (status, arn),
                )
                found.append(self.instance_json(tx, arn))
        return {"containerInstances": found, "failures": failures}

    def deregister_container_instance(self, body: dict[str, Any]) -> dict[str, Any]:
        """DEREGISTERED; refused while tasks are active unless ``force``, which stops them.

        With ``force`` every active task of the instance is asked to stop (UserInitiated): the
        agent keeps serving the deregistered instance until those tasks' processes are gone and
        they are STOPPED, so their devices are never handed out while a process still uses them.
        """
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))
            [(_ref, arn)] = self._instance_arns(tx, cluster, [body.get("containerInstance", "")])
            if not arn:
                raise InvalidParameterException("Container instance not found.")
            active = tx.one(
                "SELECT COUNT(*) AS n FROM tasks WHERE instance_arn = ? AND last_status != 'STOPPED'",
                (arn,),
            )
            if active and active["n"] and not body.get("force"):
                raise InvalidParameterException(
                    "Found running tasks on the instance; use force to deregister anyway."
                )
            for task in tx.execute(
                "SELECT * FROM tasks WHERE instance_arn = ? AND last_status != 'STOPPED'", (arn,)
            ):  # with force: no task is left running unaccounted for (its agent stops it)
                self._request_stop(
                    tx, task, "Task stopped: its container instance was deregistered (force)"
                )
            tx.execute(
                "UPDATE container_instances SET status = 'DEREGISTERED', agent_connected = 0,"
                " version = version + 1 WHERE arn = ?",
                (arn,),
            )
            return {"containerInstance": self.instance_json(tx, arn)}

    def set_agent_connected(self, arn: str, connected: bool) -> None:
        """Agents report themselves (dis)connected; ``agentConnected`` gates placement."""
        with self.store.transaction(exclusive=True) as tx:
            tx.execute(
                "UPDATE container_instances SET agent_connected = ?, heartbeat_at = ? WHERE arn = ?",
                (int(connected), time.time(), arn),
            )
