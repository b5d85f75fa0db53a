"""Resource invariants of the store, checked inside every transaction that moves resources.

For each container instance touched: every device row held by a task is held by an active task
of that instance that lists it, and every device an active task lists is held by it (so no
device is given twice); the CPU and memory of its active tasks fit what it registered, so
``registered - sum(active tasks) == remaining >= 0``.  A violation raises ``InvariantError``,
which rolls the transaction back: a bug shows up as a refused call, never as a double booking.
"""

from __future__ import annotations

from kiln.cluster.errors import ServerException
from kiln.cluster.store import Tx, loads


class InvariantError(ServerException):
    """The store would break a resource invariant; the transaction is rolled back."""


def check_instance(tx: Tx, arn: str) -> None:
    """Check the invariants of one container instance inside the open transaction ``tx``."""
    inst = tx.one("SELECT cpu, memory FROM container_instances WHERE arn = ?", (arn,))
    if inst is None:
        return
    tasks = tx.execute(
        "SELECT arn, cpu, memory, containers FROM tasks"
        " WHERE instance_arn = ? AND last_status != 'STOPPED'",
        (arn,),
    )
    listed: dict[str, str] = {}
    for t in tasks:
        for c in loads(t["containers"]):
            for d in c["devices"]:
                if d["device_id"] in listed:
                    raise InvariantError(
                        f"device {d['device_id']} of {arn} given to {listed[d['device_id']]}"
                        f" and {t['arn']}"
                    )
                listed[d["device_id"]] = t["arn"]
    held = {
        r["device_id"]: r["task_arn"]
        for r in tx.execute(
            "SELECT device_id, task_arn FROM devices WHERE instance_arn = ?"
            " AND task_arn IS NOT NULL",
            (arn,),
        )
    }
    if held != listed:
        raise InvariantError(f"device reservations of {arn} disagree with its tasks")
    for field in ("cpu", "memory"):
        used = sum(int(t[field]) for t in tasks)
        if used < 0 or used > int(inst[field]):
            raise InvariantError(f"{field} of {arn}: tasks hold {used} of {inst[field]} registered")


__all__ = ["InvariantError", "check_instance"]
