"""The container agent: runs each placed task's containers as local processes.

One agent serves one or more container instances (``kiln cluster serve`` embeds one for every
instance in its store; ``kiln cluster agent --instance ARN`` runs one elsewhere against a shared
PostgreSQL store).  Run only one agent per instance.

Each container is started as ``sh -c WRAPPER <workdir>/cN <command...>`` in its own session.  The
wrapper writes its pid to ``cN.pid`` before running the command and the exit status to ``cN.exit``
after, so an agent that crashed at any point can, on restart:

* re-adopt a live process (pid *and* psutil create-time must match the record: no pid reuse),
* find a process it launched but never recorded (pid file or command line naming the work dir),
* mark a dead one STOPPED with the exit status from ``cN.exit`` and free its devices.

Devices reach the process through the environment: ``AWS_NEURON_VISIBLE_DEVICES`` and
``NEURON_RT_VISIBLE_CORES`` for Neuron devices, ``NVIDIA_VISIBLE_DEVICES`` and
``CUDA_VISIBLE_DEVICES`` for GPUs.  Before starting, device files are checked under the
instance's device root (``/`` for real devices).  A *simulated* instance registered without a
device root has no device files, and the check is skipped for it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

import psutil

from kiln.cluster.service import ClusterService

log = logging.getLogger(__name__)

WRAPPER = 'p="$0"; echo $$ > "$p.pid"; "$@"; rc=$?; echo $rc > "$p.exit"; exit $rc'
STOP_GRACE_S = 3.0


@dataclasses.dataclass
class _Proc:
    """One container's process: our child (``popen``) or a re-adopted one (``ps``)."""

    prefix: str
    pid: int
    start: float
    popen: subprocess.Popen | None = None
    ps: psutil.Process | None = None

    def exit_status(self) -> tuple[bool, int | None]:
        """(exited, exit code if known)."""
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is None:
                return False, None
            return True, _read_exit(self.prefix, rc)
        assert self.ps is not None
        try:
            if self.ps.is_running() and self.ps.status() != psutil.STATUS_ZOMBIE:
                return False, None
        except psutil.Error:
            pass
        return True, _read_exit(self.prefix, None)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _read_exit(prefix: str, fallback: int | None) -> int | None:
    try:
        with open(prefix + ".exit") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        if fallback is not None and fallback < 0:
            return 128 - fallback  # killed by a signal: shell convention
        return fallback


def _alive(pid: int, start: float | None) -> psutil.Process | None:
    """The process ``pid`` if it is alive and (when given) started at ``start``."""
    try:
        ps = psutil.Process(pid)
        if ps.status() == psutil.STATUS_ZOMBIE:
            return None
        if start is not None and abs(ps.create_time() - start) > 0.05:
            return None
        return ps
    except psutil.Error:
        return None


def device_environment(devices: list[dict[str, Any]]) -> dict[str, str]:
    """Environment that hands a process exactly ``devices``."""
    env: dict[str, str] = {}
    neuron = sorted((d for d in devices if d["kind"] == "neuron"), key=lambda d: d["idx"])
    gpus = sorted((d for d in devices if d["kind"] == "gpu"), key=lambda d: d["idx"])
    if neuron:
        from kiln.devices import discovery

        env["AWS_NEURON_VISIBLE_DEVICES"] = ",".join(str(d["idx"]) for d in neuron)
        env["NEURON_RT_VISIBLE_CORES"] = discovery.neuron_core_ranges(
            [
                discovery.Device(
                    kind="neuron",
                    index=d["idx"],
                    path=d["path"],
                    cores=d["cores"],
                    memory_mib=d.get("memory_mib") or 0,
                    name=d.get("name") or "neuron",
                    uuid=d.get("uuid"),
                )
                for d in neuron
            ]
        )
    if gpus:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(d.get("uuid") or str(d["idx"]) for d in gpus)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d["idx"]) for d in gpus)
    return env


class Agent:
    """Polls the store for its instances' tasks and keeps their processes in step."""

    def __init__(
        self,
        service: ClusterService,
        work_dir: str,
        instance_arns: list[str] | None = None,
        poll_interval: float = 0.1,
    ) -> None:
        self.service = service
        self.work_dir = os.path.abspath(work_dir)
        self.instance_arns = instance_arns
        self.poll_interval = poll_interval
        self._procs: dict[str, list[_Proc]] = {}
        self._kill_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        os.makedirs(self.work_dir, exist_ok=True)

    # -- loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kiln-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # keep serving; the next pass retries
                log.exception("agent step failed")
            self._stop.wait(self.poll_interval)

    def _instances(self) -> list[dict[str, Any]]:
        rows = self.service.store.query(
            "SELECT arn, simulated, device_root FROM container_instances"
            " WHERE status != 'DEREGISTERED'"
        )
        if self.instance_arns is not None:
            rows = [r for r in rows if r["arn"] in self.instance_arns]
        return rows

    def step(self) -> None:
        """One pass: start, reconcile, stop and reap every active task of our instances."""
        for inst in self._instances():
            for task in self.service.agent_tasks(inst["arn"]):
                self._handle(inst, task)

    def _handle(self, inst: dict[str, Any], task: dict[str, Any]) -> None:
        arn = task["arn"]
        status = task["last_status"]
        if arn not in self._procs:
            if status == "PROVISIONING":
                if task["desired_status"] == "RUNNING" and self.service.claim_task(
                    arn, self._task_dir(arn)
                ):
                    self._launch(inst, task)
                return
            if not self._recover(inst, task):
                return
        procs = self._procs[arn]
        if task["desired_status"] == "STOPPED":
            self._terminate(arn, procs)
        finished = [p.exit_status() for p in procs]
        if any(done for done, _ in finished):
            if not all(done for done, _ in finished):
                self._terminate(arn, procs)  # an essential container exited: stop the rest
                finished = [p.exit_status() for p in procs]
                if not all(done for done, _ in finished):
                    return
            codes = [code for _, code in finished]
            first = next((c for c in codes if c is not None), None)
            reason = (
                "Task stopped by user"
                if task["desired_status"] == "STOPPED"
                else f"Essential container in task exited (exit code {first})"
            )
            self.service.mark_stopped(arn, first, reason)
            self._procs.pop(arn, None)
            self._kill_at.pop(arn, None)

    def _terminate(self, arn: str, procs: list[_Proc]) -> None:
        now = time.monotonic()
        if arn not in self._kill_at:
            self._kill_at[arn] = now + STOP_GRACE_S
            for p in procs:
                p.signal(signal.SIGTERM)
        elif now >= self._kill_at[arn]:
            for p in procs:
                p.signal(signal.SIGKILL)
            for p in procs:
                if p.popen is not None:
                    try:
                        p.popen.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass

    # -- starting -----------------------------------------------------------------------------
    def _task_dir(self, arn: str) -> str:
        return os.path.join(self.work_dir, arn.rsplit("/", 1)[-1])

    def _missing_device(self, inst: dict[str, Any], task: dict[str, Any]) -> str | None:
        if inst["simulated"] and not inst["device_root"]:
            return None  # simulated instance without device files: nothing to check
        root = inst["device_root"] or "/"
        for c in task["containers"]:
            paths = [d["path"] for d in c["devices"] if d.get("path")] + list(
                c.get("hostDevices") or []
            )
            for path in paths:
                full = os.path.join(root, path.lstrip("/"))
                if not os.path.exists(full):
                    return f"CannotStartContainerError: device {path} not found ({full} is missing)"
        return None

    def _launch(self, inst: dict[str, Any], task: dict[str, Any]) -> None:
        arn = task["arn"]
        missing = self._missing_device(inst, task)
        if missing:
            self.service.mark_stopped(arn, None, missing, "TaskFailedToStart")
            return
        task_dir = self._task_dir(arn)
        os.makedirs(task_dir, exist_ok=True)
        procs: list[_Proc] = []
        for i, c in enumerate(task["containers"]):
            if not c.get("command"):
                for p in procs:
                    p.signal(signal.SIGKILL)
                self.service.mark_stopped(
                    arn,
                    None,
                    f"CannotStartContainerError: container {c['name']} has no command",
                    "TaskFailedToStart",
                )
                return
            env = dict(os.environ)
            env.update({k: str(v) for k, v in (c.get("environment") or {}).items()})
            env.update(device_environment(c["devices"]))
            # not KILN_*: Kiln's config rejects unknown KILN_ variables in the child
            env.update(CLUSTER_TASK_ARN=arn, CLUSTER_CONTAINER_NAME=c["name"])
            prefix = os.path.join(task_dir, f"c{i}")
            with open(prefix + ".log", "ab") as out:
                try:
                    popen = subprocess.Popen(
                        ["sh", "-c", WRAPPER, prefix, *[str(a) for a in c["command"]]],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        cwd=task_dir,
                        start_new_session=True,
                    )
                except OSError as e:
                    self.service.mark_stopped(
                        arn, None, f"CannotStartContainerError: {e}", "TaskFailedToStart"
                    )
                    return
            try:
                start = psutil.Process(popen.pid).create_time()
            except psutil.Error:
                start = time.time()
            procs.append(_Proc(prefix, popen.pid, start, popen=popen))
        self._procs[arn] = procs
        self.service.mark_running(arn, [(p.pid, p.start) for p in procs])

    # -- after a restart ----------------------------------------------------------------------
    def _recover(self, inst: dict[str, Any], task: dict[str, Any]) -> bool:
        """Re-adopt the processes of a task we do not track; False if it was settled here."""
        arn = task["arn"]
        task_dir = task["work_dir"] or self._task_dir(arn)
        procs: list[_Proc] = []
        dead_codes: list[int | None] = []
        traces = False
        for i, c in enumerate(task["containers"]):
            prefix = os.path.join(task_dir, f"c{i}")
            traces = traces or bool(c.get("pid")) or os.path.exists(prefix + ".pid")
            if c.get("pid"):
                ps = _alive(int(c["pid"]), c.get("pidStart"))
            else:
                ps = self._find_unrecorded(prefix)
            if ps is not None:
                procs.append(_Proc(prefix, ps.pid, ps.create_time(), ps=ps))
            else:
                dead_codes.append(_read_exit(prefix, None))
        if not procs and not traces and task["last_status"] == "PENDING":
            # claimed, but the agent died before starting anything: start it now (no task lost)
            if task["desired_status"] == "STOPPED":
                self.service.mark_stopped(arn, None, "Task stopped by user", "UserInitiated")
            else:
                self._launch(inst, task)
            return False
        if procs:
            self._procs[arn] = procs
            if task["last_status"] != "RUNNING" or any(
                not c.get("pid") for c in task["containers"]
            ):
                self.service.mark_running(arn, [(p.pid, p.start) for p in procs])
            return True
        code = next((c for c in dead_codes if c is not None), None)
        self.service.mark_stopped(
            arn,
            code,
            f"Task process exited while the agent was down (exit code {code})",
            "EssentialContainerExited",
        )
        return False

    @staticmethod
    def _find_unrecorded(prefix: str) -> psutil.Process | None:
        try:
            with open(prefix + ".pid") as f:
                ps = _alive(int(f.read().strip()), None)
            if ps is not None and prefix in " ".join(ps.cmdline()):
                return ps
        except (OSError, ValueError, psutil.Error):
            pass
        for ps in psutil.process_iter(["cmdline"]):
            cmd = ps.info.get("cmdline") or []
            if len(cmd) > 3 and cmd[0] == "sh" and cmd[3] == prefix:
                return _alive(ps.pid, None)
        return None


def task_output(work_dir: str, task_arn: str, container_index: int = 0) -> str:
    """The captured stdout/stderr of one container of a task run by an agent in ``work_dir``."""
    path = os.path.join(work_dir, task_arn.rsplit("/", 1)[-1], f"c{container_index}.log")
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
