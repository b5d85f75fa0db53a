"""The container agent: runs each placed task's containers as local processes.

One agent serves one or more container instances (``kiln cluster serve`` embeds one for every
instance in its store; ``kiln cluster agent --instance ARN`` runs one elsewhere against a shared
PostgreSQL store).  Run only one agent per instance.

Containers start as described in ``kiln.cluster.procs`` (own session, pid and exit files, task
marker in the environment), in ``dependsOn`` order.  A task stops when an *essential* container
exits, when every container has exited, or when StopTask asks: then every process of the task
(its process groups and anything carrying its marker) gets SIGTERM, after the task's
``stopTimeout`` (largest over its containers, ECS default 30 s) SIGKILL, and only when none is
left is the task marked STOPPED and its devices freed.  A launch failure stops that task with a
reason; it never stops the agent loop or other tasks.

After a crash the agent, on restart, re-adopts live processes (pid *and* create time must match:
no pid reuse), finds ones it launched but never recorded (pid file), and stops tasks whose
processes are gone.  A periodic sweep kills leftover processes of tasks the store shows STOPPED.

A task's environment is clean: a minimal base (PATH, LANG, HOME), the task definition's
variables, its ``secrets`` (from the agent's secrets file), the device variables
(``AWS_NEURON_VISIBLE_DEVICES``/``NEURON_RT_VISIBLE_CORES``, ``NVIDIA_VISIBLE_DEVICES``/
``CUDA_VISIBLE_DEVICES``) and ``CLUSTER_TASK_ARN``/``CLUSTER_CONTAINER_NAME``.  ``user`` is
honoured when the agent runs as root (else only the agent's own user is accepted);
``workingDirectory`` becomes the process's working directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

import psutil

from kiln.cluster import procs
from kiln.cluster.procs import MARKER, WRAPPER, alive, read_exit
from kiln.cluster.service import ClusterService

log = logging.getLogger(__name__)

DEFAULT_STOP_TIMEOUT_S = 30.0
DEFAULT_LOG_CAP = 64 * 1024 * 1024
SWEEP_INTERVAL_S = 5.0
HEARTBEAT_INTERVAL_S = 1.0
_BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


class LaunchError(Exception):
    """A container cannot be started; the message is the task's stop reason."""


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
            return True, read_exit(self.prefix, rc)
        assert self.ps is not None
        try:
            if self.ps.is_running() and self.ps.status() != psutil.STATUS_ZOMBIE:
                return False, None
        except psutil.Error:
            pass
        return True, read_exit(self.prefix, None)


@dataclasses.dataclass
class _Run:
    """A task this agent is driving."""

    arn: str
    procs: dict[int, _Proc] = dataclasses.field(default_factory=dict)  # container -> process
    codes: dict[int, int | None] = dataclasses.field(default_factory=dict)  # exited containers
    skipped: set[int] = dataclasses.field(default_factory=set)  # can never start (dependsOn)
    stop: tuple[str, str] | None = None  # (reason, stop code) once stopping
    kill_at: float = 0.0

    def pgids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]


def device_environment(devices: list[dict[str, Any]]) -> dict[str, str]:
    """Environment that hands a process exactly ``devices``."""
    env: dict[str, str] = {}
    neuron = sorted((d for d in devices if d["kind"] == "neuron"), key=lambda d: d["idx"])
    gpus = sorted((d for d in devices if d["kind"] == "gpu"), key=lambda d: d["idx"])
    if neuron:
        env["AWS_NEURON_VISIBLE_DEVICES"] = ",".join(str(d["idx"]) for d in neuron)
        env["NEURON_RT_VISIBLE_CORES"] = neuron_core_ranges(neuron)
    if gpus:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(d.get("uuid") or str(d["idx"]) for d in gpus)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d["idx"]) for d in gpus)
    return env


def neuron_core_ranges(devices: list[dict[str, Any]]) -> str:
    """NeuronCore ids of ``devices`` (each device owns ``cores`` consecutive ids) as ranges."""
    ids: list[int] = []
    for d in devices:
        ids.extend(range(d["idx"] * d["cores"], (d["idx"] + 1) * d["cores"]))
    ranges: list[str] = []
    for i in sorted(ids):
        if ranges and int(ranges[-1].split("-")[-1]) == i - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{i}"
        else:
            ranges.append(str(i))
    return ",".join(ranges)


def check_executable(program: str, path: str, cwd: str) -> None:
    """Raise LaunchError unless ``program`` names an executable file: a name with a ``/`` is
    taken relative to ``cwd``, a bare name is looked up on ``path`` (the task's ``PATH``)."""
    if "/" in program:
        full = os.path.join(cwd, program)
        if not os.path.isfile(full):
            raise LaunchError(f"executable {program!r} not found ({full} is not a file)")
        if not os.access(full, os.X_OK):
            raise LaunchError(
                f"executable {program!r} is not executable ({full}: permission denied)"
            )
        return
    if shutil.which(program, path=path) is None:
        raise LaunchError(f"executable {program!r} not found in $PATH ({path})")


def _dependencies_state(c: dict[str, Any], names: dict[str, int], run: _Run) -> str:
    """ "ready", "wait" or "never" for container ``c`` given its ``dependsOn``."""
    for dep in c.get("dependsOn") or []:
        i = names[dep["containerName"]]
        cond = dep["condition"]
        if i in run.skipped:
            return "never"
        if cond == "START":
            if i not in run.procs and i not in run.codes:
                return "wait"
        elif i not in run.codes:
            return "wait"
        elif cond == "SUCCESS" and run.codes[i] != 0:
            return "never"
    return "ready"


class Agent:
    """Polls the store for its instances' tasks and keeps their processes in step."""

    def __init__(
        self,
        service: ClusterService,
        work_dir: str,
        instance_arns: list[str] | None = None,
        poll_interval: float = 0.1,
        secrets_file: str | None = None,
        log_cap_bytes: int = DEFAULT_LOG_CAP,
    ) -> None:
        self.service = service
        self.work_dir = os.path.abspath(work_dir)
        self.instance_arns = instance_arns
        self.poll_interval = poll_interval
        self.secrets_file = secrets_file
        self.log_cap_bytes = log_cap_bytes
        self._runs: dict[str, _Run] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_sweep = 0.0
        self._beats: dict[str, float] = {}
        self._forced: list[tuple[str, str]] = []  # (arn, reason): stops the store could not take
        service.stop_hooks.append(self.force_stop)
        os.makedirs(self.work_dir, mode=0o700, exist_ok=True)
        os.chmod(self.work_dir, 0o700)

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
            except Exception:  # the store is unreachable: keep serving, the next pass retries
                log.exception("agent step failed")
            self._stop.wait(self.poll_interval)

    def _instances(self) -> list[dict[str, Any]]:
        """Instances to serve: every registered one, and a DEREGISTERED one while it still has
        active tasks (force deregistration: they are stopping and need their agent to end)."""
        rows = self.service.store.query(
            "SELECT arn, status, simulated, device_root FROM container_instances"
            " WHERE status != 'DEREGISTERED' OR arn IN"
            " (SELECT instance_arn FROM tasks WHERE last_status != 'STOPPED')"
        )
        if self.instance_arns is not None:
            rows = [r for r in rows if r["arn"] in self.instance_arns]
        return rows

    def step(self) -> None:
        """One pass: heartbeat, then start, reconcile, stop and reap every active task."""
        while self._forced:
            arn, reason = self._forced.pop(0)
            if arn in self._runs:
                self._begin_stop(self._runs[arn], reason, "UserInitiated")
        now = time.monotonic()
        for inst in self._instances():
            if inst["status"] != "DEREGISTERED" and now >= self._beats.get(inst["arn"], 0.0):
                self._beats[inst["arn"]] = now + HEARTBEAT_INTERVAL_S
                self.service.heartbeat(inst["arn"])
            for task in self.service.agent_tasks(inst["arn"]):
                try:
                    self._handle(inst, task)
                except Exception as e:  # one task's trouble never stalls the others
                    log.exception("task %s failed in the agent", task["arn"])
                    self._fail(task["arn"], f"agent error: {type(e).__name__}: {e}")
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            self.sweep_orphans()

    def force_stop(self, arn: str, reason: str) -> None:
        """Stop ``arn``'s processes even though the store could not record StopTask."""
        self._forced.append((arn, reason))

    def _fail(self, arn: str, reason: str) -> None:
        try:
            run = self._runs.setdefault(arn, _Run(arn))
            self._begin_stop(run, reason, "TaskFailedToStart")
            self._finish_if_gone(run, None)
        except Exception:  # the store is failing too: the next pass retries
            log.exception("could not stop task %s", arn)

    def _handle(self, inst: dict[str, Any], task: dict[str, Any]) -> None:
        arn = task["arn"]
        run = self._runs.get(arn)
        if run is None:
            if task["last_status"] == "PROVISIONING":
                if task["desired_status"] == "RUNNING" and self.service.claim_task(
                    arn, self._task_dir(arn)
                ):
                    run = self._runs[arn] = _Run(arn)
                    self._prepare(inst, task, run)
                    self._launch_ready(task, run)
                    if run.procs:
                        self.service.mark_running(arn, self._pids(task, run))
                    if run.stop is not None:
                        self._finish_if_gone(run, task["containers"])
                return
            run = self._recover(task)
        self._advance(task, run)

    # -- the task state machine ---------------------------------------------------------------
    def _advance(self, task: dict[str, Any], run: _Run) -> None:
        containers = task["containers"]
        exited: dict[int, int | None] = {}
        for i, p in run.procs.items():
            if i not in run.codes:
                done, code = p.exit_status()
                if done:
                    exited[i] = code
        if exited and run.stop is None:  # on their own: STOPPED now, not when the task ends
            self.service.mark_containers_exited(task["arn"], exited)
        run.codes.update(exited)
        if run.stop is None:
            reason = self._stop_reason(task, run)
            if reason is None and task["last_status"] in ("PENDING", "RUNNING"):
                started = len(run.procs)
                self._launch_ready(task, run)
                if len(run.procs) != started:
                    self.service.mark_running(task["arn"], self._pids(task, run))
                reason = self._stop_reason(task, run)
            if reason is not None:
                self._begin_stop(run, *reason)
        if run.stop is None:
            for i in run.procs:
                procs.cap_log(self._prefix(task["arn"], i) + ".log", self.log_cap_bytes)
            return
        self._finish_if_gone(run, containers)

    def _stop_reason(self, task: dict[str, Any], run: _Run) -> tuple[str, str] | None:
        if task["desired_status"] == "STOPPED":
            return task.get("stopped_reason") or "Task stopped by user", "UserInitiated"
        containers = task["containers"]
        for i, code in sorted(run.codes.items()):
            if containers[i].get("essential", True):
                return (
                    f"Essential container in task exited (exit code {code})",
                    "EssentialContainerExited",
                )
        names = {c["name"]: i for i, c in enumerate(containers)}
        for i, c in enumerate(containers):
            started = i in run.procs or i in run.codes
            if not started and _dependencies_state(c, names, run) == "never":
                run.skipped.add(i)
        if len(run.codes) + len(run.skipped) == len(containers):
            return "All containers exited", "EssentialContainerExited"
        return None

    def _begin_stop(self, run: _Run, reason: str, code: str) -> None:
        if run.stop is not None:
            return
        run.stop = (reason, code)
        timeout = self._stop_timeout(run.arn)
        run.kill_at = time.monotonic() + timeout
        found = procs.task_processes(run.arn, run.pgids())
        procs.signal_all(found, run.pgids(), signal.SIGTERM)

    def _stop_timeout(self, arn: str) -> float:
        rows = self.service.store.query("SELECT containers FROM tasks WHERE arn = ?", (arn,))
        if not rows:
            return DEFAULT_STOP_TIMEOUT_S
        values = [c.get("stopTimeout") for c in json.loads(rows[0]["containers"])]
        given = [float(v) for v in values if v is not None]
        return max(given) if given else DEFAULT_STOP_TIMEOUT_S

    def _finish_if_gone(self, run: _Run, containers: list[dict[str, Any]] | None) -> None:
        """Mark the task STOPPED once none of its processes is left; SIGKILL after the timeout."""
        for p in run.procs.values():
            if p.popen is not None:
                p.popen.poll()  # reap our direct children
        left = procs.task_processes(run.arn, run.pgids())
        if left:
            if time.monotonic() >= run.kill_at:
                procs.signal_all(left, run.pgids(), signal.SIGKILL)
            return
        for i, p in run.procs.items():
            if i not in run.codes:
                run.codes[i] = p.exit_status()[1]
        n = len(containers) if containers is not None else 0
        codes = [run.codes.get(i) for i in range(n)]
        assert run.stop is not None
        self.service.mark_stopped(run.arn, codes, run.stop[0], run.stop[1])
        self._runs.pop(run.arn, None)

    # -- starting -----------------------------------------------------------------------------
    def _task_dir(self, arn: str) -> str:
        return os.path.join(self.work_dir, arn.rsplit("/", 1)[-1])

    def _prefix(self, arn: str, index: int) -> str:
        return os.path.join(self._task_dir(arn), f"c{index}")

    @staticmethod
    def _pids(task: dict[str, Any], run: _Run) -> list[tuple[int, float] | None]:
        return [
            (run.procs[i].pid, run.procs[i].start) if i in run.procs else None
            for i in range(len(task["containers"]))
        ]

    def _prepare(self, inst: dict[str, Any], task: dict[str, Any], run: _Run) -> None:
        missing = self._missing_device(inst, task)
        if missing:
            self._begin_stop(run, missing, "TaskFailedToStart")
        os.makedirs(self._task_dir(task["arn"]), mode=0o700, exist_ok=True)

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

    def _launch_ready(self, task: dict[str, Any], run: _Run) -> None:
        """Start every container whose dependencies are met; a failure stops the task."""
        if run.stop is not None:
            return
        containers = task["containers"]
        names = {c["name"]: i for i, c in enumerate(containers)}
        for i, c in enumerate(containers):
            if i in run.procs or i in run.codes or i in run.skipped:
                continue
            if _dependencies_state(c, names, run) != "ready":
                continue
            try:
                run.procs[i] = self._launch_one(task, i, c)
            except (LaunchError, OSError, ValueError, subprocess.SubprocessError) as e:
                reason = str(e) if isinstance(e, LaunchError) else f"{type(e).__name__}: {e}"
                self._begin_stop(
                    run,
                    f"CannotStartContainerError: container {c['name']}: {reason}",
                    "TaskFailedToStart",
                )
                return

    def _environment(self, task: dict[str, Any], c: dict[str, Any], home: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["HOME"] = home
        env.update({k: str(v) for k, v in (c.get("environment") or {}).items()})
        env.update(self._secrets(c.get("secrets") or []))
        env.update(device_environment(c["devices"]))
        env[MARKER] = task["arn"]
        env["CLUSTER_CONTAINER_NAME"] = c["name"]
        return env

    def _secrets(self, wanted: list[dict[str, str]]) -> dict[str, str]:
        if not wanted:
            return {}
        if not self.secrets_file:
            raise LaunchError("the task asks for secrets but the agent has no --secrets-file")
        try:
            with open(self.secrets_file) as f:
                source = json.load(f)
        except (OSError, ValueError) as e:
            raise LaunchError(f"cannot read the agent's secrets file: {e}") from e
        out = {}
        for s in wanted:
            value = source.get(s["valueFrom"]) if isinstance(source, dict) else None
            if not isinstance(value, str):
                raise LaunchError(f"secret {s['valueFrom']!r} is not in the agent's secrets file")
            out[s["name"]] = value
        return out

    @staticmethod
    def _user(spec: str | None) -> tuple[int | None, int, str]:
        """(uid, gid, home) to run as; (None, None, home) for the agent's own user."""
        me = os.getuid()
        if not spec:
            return None, os.getgid(), pwd.getpwuid(me).pw_dir
        name, _, group = spec.partition(":")
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError as e:
            raise LaunchError(f"user {name!r} does not exist on this instance") from e
        gid = entry.pw_gid
        if group:
            import grp

            try:
                gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            except KeyError as e:
                raise LaunchError(f"group {group!r} does not exist on this instance") from e
        if entry.pw_uid == me and gid == os.getgid():
            return None, gid, entry.pw_dir
        if me != 0:
            raise LaunchError(
                f"the agent runs as uid {me} and cannot switch to user {spec!r}; run the agent"
                " as root or drop 'user'"
            )
        return entry.pw_uid, gid, entry.pw_dir

    def _launch_one(self, task: dict[str, Any], i: int, c: dict[str, Any]) -> _Proc:
        if not c.get("command"):
            raise LaunchError("no command")
        uid, gid, home = self._user(c.get("user"))
        env = self._environment(task, c, home)
        task_dir = self._task_dir(task["arn"])
        os.makedirs(task_dir, mode=0o700, exist_ok=True)
        cwd = c.get("workingDirectory") or task_dir
        if not os.path.isdir(cwd):
            raise LaunchError(f"workingDirectory {cwd!r} does not exist on this instance")
        command = [str(a) for a in c["command"]]
        name = os.path.basename(command[0]) or command[0]  # the wrapper's $0 in shell messages
        check_executable(command[0], env["PATH"], cwd)
        if uid is not None:  # the wrapper stays root (pid/exit files); the command drops to uid
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise LaunchError("switching users needs setpriv (util-linux) on the instance")
            os.chown(task_dir, uid, gid)
            command = [
                setpriv,
                f"--reuid={uid}",
                f"--regid={gid}",
                "--clear-groups",
                "--",
                *command,
            ]
        prefix = self._prefix(task["arn"], i)
        fd = os.open(prefix + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            popen = subprocess.Popen(
                ["sh", "-c", WRAPPER, name, prefix, *command],
                stdout=fd,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            os.close(fd)
        try:
            start = psutil.Process(popen.pid).create_time()
        except psutil.Error:
            start = time.time()
        return _Proc(prefix, popen.pid, start, popen=popen)

    # -- after a restart ----------------------------------------------------------------------
    def _recover(self, task: dict[str, Any]) -> _Run:
        """Re-adopt the processes of a task this agent does not track yet."""
        arn = task["arn"]
        run = self._runs[arn] = _Run(arn)
        task_dir = task["work_dir"] or self._task_dir(arn)
        for i, c in enumerate(task["containers"]):
            prefix = os.path.join(task_dir, f"c{i}")
            if c.get("pid"):
                ps = alive(int(c["pid"]), c.get("pidStart"))
            else:
                ps = self._find_unrecorded(prefix)
            if ps is not None:
                run.procs[i] = _Proc(prefix, ps.pid, ps.create_time(), ps=ps)
            elif c.get("pid") or os.path.exists(prefix + ".pid"):
                run.codes[i] = read_exit(prefix, None)  # started, and gone while we were down
        if run.codes and not run.procs and task["desired_status"] != "STOPPED":
            code = next((c for c in run.codes.values() if c is not None), None)
            self._begin_stop(
                run,
                f"Task process exited while the agent was down (exit code {code})",
                "EssentialContainerExited",
            )
        if run.procs:
            if run.codes and task["desired_status"] != "STOPPED":
                self.service.mark_containers_exited(arn, dict(run.codes))
            self.service.mark_running(arn, self._pids(task, run))
        return run

    @staticmethod
    def _find_unrecorded(prefix: str) -> psutil.Process | None:
        try:
            with open(prefix + ".pid") as f:
                ps = alive(int(f.read().strip()), None)
            if ps is not None and prefix in " ".join(ps.cmdline()):
                return ps
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    # -- orphans ------------------------------------------------------------------------------
    def sweep_orphans(self) -> int:
        """SIGKILL live processes of tasks the store shows STOPPED, and of tasks this agent
        launched (their directory is in its work dir) that the store does not know at all
        (a store restored from an old copy); returns how many processes were signalled."""
        marked = procs.marked_processes()
        if not marked:
            return 0
        known: dict[str, str] = {}
        arns = list(marked)
        for start in range(0, len(arns), 100):
            chunk = arns[start : start + 100]
            rows = self.service.store.query(
                f"SELECT arn, last_status FROM tasks WHERE arn IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            known.update((r["arn"], r["last_status"]) for r in rows)
        killed = 0
        for arn, found in marked.items():
            status = known.get(arn)
            mine = os.path.isdir(self._task_dir(arn))
            if status == "STOPPED" or (status is None and mine):
                procs.signal_all(found, [], signal.SIGKILL)
                killed += len(found)
        if killed:
            log.warning("killed %d leftover processes of stopped or unknown tasks", killed)
        return killed


def task_output(work_dir: str, task_arn: str, container_index: int = 0) -> str:
    """The captured stdout/stderr of one container of a task run by an agent in ``work_dir``.

    Raises ValueError for a task id that is not a plain id, FileNotFoundError for no output.
    """
    task_id = task_arn.rsplit("/", 1)[-1]
    if not task_id.isalnum():
        raise ValueError(f"{task_arn!r} is not a task id or ARN")
    path = os.path.join(work_dir, task_id, f"c{int(container_index)}.log")
    with open(path, errors="replace") as f:
        return f.read()
