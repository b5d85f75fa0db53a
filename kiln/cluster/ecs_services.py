"""ECS services (Create/Update/Delete/Describe/ListServices) and resource tags.

A service keeps ``desiredCount`` copies of its task definition running: ``reconcile_services``
(run by the server's upkeep every few seconds, and callable directly) starts the missing copies
through RunTask (``startedBy=ecs-svc/<name>``, group ``service:<name>``), so a failed or stopped
copy is replaced, and stops surplus ones when the count goes down.  DeleteService needs
``desiredCount`` 0 unless ``force``; it stops the service's tasks and leaves it INACTIVE.
Tags (TagResource, UntagResource, ListTagsForResource) attach to clusters, task definitions,
services, tasks and container instances that exist.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from kiln.cluster import placement
from kiln.cluster.errors import (
    InvalidParameterException,
    ResourceNotFoundException,
    ServiceNotActiveException,
    ServiceNotFoundException,
)
from kiln.cluster.paging import paginate
from kiln.cluster.store import dumps, loads

if TYPE_CHECKING:
    from kiln.cluster.store import Store, Tx

_TAGGABLE = {  # ARN kind -> (table, key column)
    "cluster": ("clusters", "arn"),
    "task-definition": ("task_definitions", "arn"),
    "service": ("services", "arn"),
    "task": ("tasks", "arn"),
    "container-instance": ("container_instances", "arn"),
}


def _deployment(row: dict[str, Any], running: int, pending: int) -> dict[str, Any]:
    """The service's one deployment (Kiln has no rolling updates: the service *is* its PRIMARY
    deployment), with the service's counts; COMPLETED once running equals desired."""
    desired = row["desired_count"]
    return {
        "id": "ecs-svc/" + hashlib.sha256(row["arn"].encode()).hexdigest()[:19],
        "status": "PRIMARY",
        "taskDefinition": row["taskdef_arn"],
        "desiredCount": desired,
        "runningCount": running,
        "pendingCount": pending,
        "launchType": "EC2",
        "createdAt": row["created_at"],
        "rolloutState": "COMPLETED" if running == desired else "IN_PROGRESS",
    }


class ServiceActions:
    """Mixed into ``ClusterService``."""

    store: Store

    # -- services -----------------------------------------------------------------------------
    def create_service(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["serviceName"]
        desired = body.get("desiredCount", 0)
        if not isinstance(desired, int) or not 0 <= desired <= 1000:
            raise InvalidParameterException("desiredCount must be a whole number from 0 to 1000")
        placement.check_launch_type(body)
        placement.validate_strategies(list(body.get("placementStrategy") or []))
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            td = self.resolve_taskdef(tx, body.get("taskDefinition") or "")  # type: ignore[attr-defined]
            arn = self.arn("service", f"{cluster}/{name}")  # type: ignore[attr-defined]
            row = tx.one("SELECT status FROM services WHERE arn = ?", (arn,))
            if row is not None and row["status"] != "INACTIVE":
                raise InvalidParameterException("Creation of service was not idempotent.")
            tx.execute("DELETE FROM services WHERE arn = ?", (arn,))
            spec = {
                k: body[k]
                for k in ("placementConstraints", "placementStrategy")
                if body.get(k) is not None
            }
            tx.execute(
                "INSERT INTO services (arn, cluster, name, taskdef_arn, desired_count, status,"
                " spec, created_at) VALUES (?, ?, ?, ?, ?, 'ACTIVE', ?, ?)",
                (arn, cluster, name, td["arn"], desired, dumps(spec), time.time()),
            )
            self._set_tags(tx, arn, body.get("tags") or [])
            return {"service": self._service_json(tx, arn)}

    def _service_row(self, tx: Tx, cluster: str, ref: str) -> dict[str, Any]:
        arn = ref if ref.startswith("arn:") else self.arn("service", f"{cluster}/{ref}")  # type: ignore[attr-defined]
        row = tx.one("SELECT * FROM services WHERE arn = ? AND cluster = ?", (arn, cluster))
        if row is None:
            raise ServiceNotFoundException("Service not found.")
        return row

    def _service_json(self, tx: Tx, arn: str) -> dict[str, Any]:
        row = tx.one("SELECT * FROM services WHERE arn = ?", (arn,))
        assert row is not None
        counts = {
            r["last_status"]: r["n"]
            for r in tx.execute(
                "SELECT last_status, COUNT(*) AS n FROM tasks WHERE cluster = ? AND started_by = ?"
                " AND last_status != 'STOPPED' GROUP BY last_status",
                (row["cluster"], "ecs-svc/" + row["name"]),
            )
        }
        spec = loads(row["spec"]) or {}
        running = counts.get("RUNNING", 0)
        pending = sum(n for s, n in counts.items() if s != "RUNNING")
        return {
            "serviceArn": arn,
            "serviceName": row["name"],
            "clusterArn": self.arn("cluster", row["cluster"]),  # type: ignore[attr-defined]
            "taskDefinition": row["taskdef_arn"],
            "desiredCount": row["desired_count"],
            "runningCount": running,
            "pendingCount": pending,
            "deployments": [_deployment(row, running, pending)],
            "status": row["status"],
            "launchType": "EC2",
            "schedulingStrategy": "REPLICA",
            "createdAt": row["created_at"],
            "placementConstraints": spec.get("placementConstraints", []),
            "placementStrategy": spec.get("placementStrategy", []),
        }

    def update_service(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            row = self._service_row(tx, cluster, body["service"])
            if row["status"] != "ACTIVE":
                raise ServiceNotActiveException("Service was not ACTIVE.")
            desired = body.get("desiredCount", row["desired_count"])
            if not isinstance(desired, int) or not 0 <= desired <= 1000:
                raise InvalidParameterException(
                    "desiredCount must be a whole number from 0 to 1000"
                )
            td_arn = row["taskdef_arn"]
            if body.get("taskDefinition"):
                td_arn = self.resolve_taskdef(tx, body["taskDefinition"])["arn"]  # type: ignore[attr-defined]
            tx.execute(
                "UPDATE services SET desired_count = ?, taskdef_arn = ? WHERE arn = ?",
                (desired, td_arn, row["arn"]),
            )
            return {"service": self._service_json(tx, row["arn"])}

    def delete_service(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction(exclusive=True) as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            row = self._service_row(tx, cluster, body["service"])
            if row["status"] == "INACTIVE":
                raise ServiceNotActiveException("Service was not ACTIVE.")
            if row["desired_count"] and not body.get("force"):
                raise InvalidParameterException(
                    "The service cannot be stopped while it is scaled above 0; set desiredCount"
                    " to 0 or use force."
                )
            tx.execute(
                "UPDATE services SET status = 'INACTIVE', desired_count = 0 WHERE arn = ?",
                (row["arn"],),
            )
            doc = self._service_json(tx, row["arn"])
        self.reconcile_services()
        return {"service": doc}

    def describe_services(self, body: dict[str, Any]) -> dict[str, Any]:
        found, failures = [], []
        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            for ref in body["services"]:
                try:
                    row = self._service_row(tx, cluster, ref)
                except ServiceNotFoundException:
                    failures.append({"arn": ref, "reason": "MISSING"})
                    continue
                found.append(self._service_json(tx, row["arn"]))
        return {"services": found, "failures": failures}

    def list_services(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction() as tx:
            cluster = self.cluster_name(tx, body.get("cluster"))  # type: ignore[attr-defined]
            rows = tx.execute(
                "SELECT arn FROM services WHERE cluster = ? AND status = 'ACTIVE' ORDER BY name",
                (cluster,),
            )
        return paginate([r["arn"] for r in rows], body, "serviceArns")

    def reconcile_services(self) -> dict[str, int]:
        """Start missing and stop surplus copies of every service; returns {arn: change}."""
        changes: dict[str, int] = {}
        for row in self.store.query("SELECT * FROM services"):
            started_by = "ecs-svc/" + row["name"]
            live = self.store.query(
                "SELECT arn FROM tasks WHERE cluster = ? AND started_by = ?"
                " AND desired_status = 'RUNNING' ORDER BY created_at DESC",
                (row["cluster"], started_by),
            )
            desired = row["desired_count"] if row["status"] == "ACTIVE" else 0
            if len(live) < desired:
                spec = loads(row["spec"]) or {}
                out = self.run_task(  # type: ignore[attr-defined]
                    {
                        "cluster": row["cluster"],
                        "taskDefinition": row["taskdef_arn"],
                        "count": min(desired - len(live), 10),
                        "startedBy": started_by,
                        "group": "service:" + row["name"],
                        **spec,
                    }
                )
                changes[row["arn"]] = len(out["tasks"])
            for extra in live[desired:]:
                self.stop_task(  # type: ignore[attr-defined]
                    {"cluster": row["cluster"], "task": extra["arn"], "reason": "Scaling down"}
                )
                changes[row["arn"]] = changes.get(row["arn"], 0) - 1
        return changes

    # -- tags ---------------------------------------------------------------------------------
    def _resource(self, tx: Tx, arn: str) -> None:
        kind = arn.split(":", 5)[-1].split("/", 1)[0] if arn.startswith("arn:") else ""
        if kind not in _TAGGABLE:
            raise InvalidParameterException(f"{arn!r} is not an ARN of a taggable resource")
        table, column = _TAGGABLE[kind]
        if tx.one(f"SELECT 1 AS ok FROM {table} WHERE {column} = ?", (arn,)) is None:
            raise ResourceNotFoundException("The specified resource could not be found.")

    @staticmethod
    def _check_tags(tags: list[dict[str, str]]) -> None:
        """InvalidParameterException unless every tag has a key (the model checks lengths)."""
        for tag in tags:
            if not tag.get("key"):
                raise InvalidParameterException("each tag needs a key")

    def _set_tags(self, tx: Tx, arn: str, tags: list[dict[str, str]]) -> None:
        """Add ``tags`` to ``arn``; a key it already has takes the new value."""
        self._check_tags(tags)
        for tag in tags:
            tx.execute("DELETE FROM tags WHERE resource_arn = ? AND key = ?", (arn, tag["key"]))
            tx.execute(
                "INSERT INTO tags (resource_arn, key, value) VALUES (?, ?, ?)",
                (arn, tag["key"], tag.get("value") or ""),
            )

    def tag_resource(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction(exclusive=True) as tx:
            self._resource(tx, body["resourceArn"])
            self._set_tags(tx, body["resourceArn"], body["tags"])
        return {}

    def untag_resource(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction(exclusive=True) as tx:
            self._resource(tx, body["resourceArn"])
            for key in body["tagKeys"]:
                tx.execute(
                    "DELETE FROM tags WHERE resource_arn = ? AND key = ?",
                    (body["resourceArn"], key),
                )
        return {}

    def list_tags_for_resource(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.transaction() as tx:
            self._resource(tx, body["resourceArn"])
            return {"tags": self._tags(tx, body["resourceArn"])}

    @staticmethod
    def _tags(tx: Tx, arn: str) -> list[dict[str, str]]:
        """``arn``'s tags, sorted by key: those given at creation plus TagResource's."""
        rows = tx.execute("SELECT key, value FROM tags WHERE resource_arn = ? ORDER BY key", (arn,))
        return [{"key": r["key"], "value": r["value"]} for r in rows]
