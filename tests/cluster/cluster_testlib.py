"""Shared helpers for the cluster tests (imported by basename; not a test module)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store, loads

PY = sys.executable


def wait_for(pred: Callable[[], Any], timeout: float = 15.0, every: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {pred}")
        time.sleep(every)


def add_instance(
    svc: ClusterService, itype: str = "trn1.32xlarge", cluster: str = "default", **extra: Any
) -> str:
    attrs = [{"name": "ecs.instance-type", "value": itype}]
    attrs += [{"name": k, "value": v} for k, v in extra.pop("attributes", {}).items()]
    body = {"cluster": cluster, "attributes": attrs, **extra}
    return svc.register_container_instance(body)["containerInstance"]["containerInstanceArn"]


def container(name: str = "main", command: list[str] | None = None, **extra: Any) -> dict:
    c = {"name": name, "image": "local", "cpu": 1024, "memory": 1024}
    c["command"] = command or [PY, "-c", "pass"]
    c.update(extra)
    return c


def neuron_all(**extra: Any) -> dict:
    return container(resourceRequirements=[{"type": "NeuronDevice", "value": "ALL"}], **extra)


def gpus(n: int, **extra: Any) -> dict:
    return container(resourceRequirements=[{"type": "GPU", "value": str(n)}], **extra)


def register(svc: ClusterService, family: str, *containers: dict, **extra: Any) -> str:
    body = {"family": family, "containerDefinitions": list(containers), **extra}
    return svc.register_task_definition(body)["taskDefinition"]["taskDefinitionArn"]


def check_invariants(store: Store) -> dict[str, Any]:
    """registered - sum(active tasks) == remaining >= 0; every device held by <= 1 active task.

    Checks the device table against the per-container records written by placement, inside one
    exclusive transaction (a consistent snapshot on SQLite and PostgreSQL alike).
    """
    svc = ClusterService(store)
    stats = {"active": 0, "held": 0}
    with store.transaction(exclusive=True) as tx:
        tasks = tx.execute("SELECT * FROM tasks WHERE last_status != 'STOPPED'")
        held_by: dict[tuple[str, str], str] = {}
        for t in tasks:
            for c in loads(t["containers"]):
                for d in c["devices"]:
                    key = (t["instance_arn"], d["device_id"])
                    assert key not in held_by, (
                        f"device {key} given to {held_by[key]} and {t['arn']}"
                    )
                    held_by[key] = t["arn"]
        for row in tx.execute("SELECT * FROM devices"):
            key = (row["instance_arn"], row["device_id"])
            assert row["task_arn"] == held_by.get(key), f"device row {key} disagrees"
        for inst in tx.execute("SELECT * FROM container_instances"):
            mine = [t for t in tasks if t["instance_arn"] == inst["arn"]]
            doc = svc.instance_json(tx, inst["arn"])
            reg = {r["name"]: r for r in doc["registeredResources"]}
            rem = {r["name"]: r for r in doc["remainingResources"]}
            for name, col in (("CPU", "cpu"), ("MEMORY", "memory")):
                used = sum(t[col] for t in mine)
                assert reg[name]["integerValue"] - used == rem[name]["integerValue"]
                assert rem[name]["integerValue"] >= 0, f"{name} overcommitted on {inst['arn']}"
            for name in ("GPU", "NEURON"):
                regs, rems = set(reg[name]["stringSetValue"]), set(rem[name]["stringSetValue"])
                assert rems <= regs
            free = tx.one(
                "SELECT COUNT(*) AS n FROM devices WHERE instance_arn = ? AND task_arn IS NULL",
                (inst["arn"],),
            )
            total = tx.one(
                "SELECT COUNT(*) AS n FROM devices WHERE instance_arn = ?", (inst["arn"],)
            )
            held = sum(1 for (ia, _d) in held_by if ia == inst["arn"])
            assert total["n"] - held == free["n"]
        stats["active"] = len(tasks)
        stats["held"] = len(held_by)
    return stats


class ServerProcess:
    """``kiln cluster serve`` as a subprocess on 127.0.0.1 with a free port."""

    def __init__(self, db: str, work_dir: str, *args: str) -> None:
        cmd = [
            PY,
            "-m",
            "kiln.tools.cli",
            "cluster",
            "--store",
            db,
            "serve",
            "--port",
            "0",
            "--work-dir",
            work_dir,
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._await_url()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _await_url(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if "listening on " in line:
                return line.split("listening on ", 1)[1].strip()
        self.kill()
        raise AssertionError("server did not start:\n" + "".join(seen))

    def kill(self) -> None:
        """SIGKILL the server only (its task processes live in their own sessions)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def kill_task_processes(store: Store) -> None:
    """Test cleanup: SIGKILL every recorded task process group still alive."""
    for t in store.query("SELECT containers FROM tasks"):
        for c in loads(t["containers"]):
            pid = c.get("pid")
            if not pid:
                continue
            try:
                if abs(psutil.Process(pid).create_time() - c.get("pidStart", 0)) < 0.05:
                    os.killpg(pid, signal.SIGKILL)
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass
