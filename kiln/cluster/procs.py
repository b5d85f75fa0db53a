"""Processes of a task: how the agent starts them, finds all of them, and ends them.

Each container runs as ``sh -c WRAPPER <name> <prefix> <command...>`` in its own session (so its
own process group); ``<name>`` (the command's base name) is the shell's ``$0``, so a shell message
names the command, not the agent's files.  The wrapper writes its pid to ``<prefix>.pid``, runs
the command in the foreground and writes the command's exit status to ``<prefix>.exit``.  It traps SIGTERM/SIGINT
with a no-op so that a group-wide SIGTERM reaches the command while the wrapper keeps waiting for
it (the trap runs only after the foreground command finishes; a trapped signal is not inherited).

Every process of a task carries ``CLUSTER_TASK_ARN=<arn>`` in its environment.  A task's
processes are those in one of its containers' process groups plus those carrying its marker:
the second catches children that called ``setsid`` or were re-parented.  A process that clears
its own environment *and* leaves the process group is not found (cgroups would be needed).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable

import psutil

log = logging.getLogger(__name__)

MARKER = "CLUSTER_TASK_ARN"
WRAPPER = 'p="$1"; shift; trap : TERM INT; echo $$ > "$p.pid"; "$@"; rc=$?; echo $rc > "$p.exit"; exit $rc'


def read_exit(prefix: str, fallback: int | None) -> int | None:
    """The exit status the wrapper recorded, else ``fallback`` (-N: killed by signal N)."""
    try:
        with open(prefix + ".exit") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        if fallback is not None and fallback < 0:
            return 128 - fallback  # killed by a signal: shell convention
        return fallback


def alive(pid: int, start: float | None) -> psutil.Process | None:
    """The process ``pid`` if it is alive and (when given) was created at ``start``."""
    try:
        ps = psutil.Process(pid)
        if ps.status() == psutil.STATUS_ZOMBIE:
            return None
        if start is not None and abs(ps.create_time() - start) > 0.05:
            return None
        return ps
    except psutil.Error:
        return None


def _marker_of(ps: psutil.Process) -> str | None:
    try:
        return ps.environ().get(MARKER)
    except (psutil.Error, OSError):
        return None


def task_processes(arn: str, pgids: Iterable[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes of task ``arn``: in one of ``pgids`` or carrying its marker."""
    groups = set(pgids)
    me = os.getpid()
    found = []
    for ps in psutil.process_iter():
        if ps.pid == me:
            continue
        try:
            if ps.status() == psutil.STATUS_ZOMBIE:
                continue
            in_group = os.getpgid(ps.pid) in groups
        except (psutil.Error, OSError):
            continue
        if in_group or _marker_of(ps) == arn:
            found.append(ps)
    return found


def marked_processes() -> dict[str, list[psutil.Process]]:
    """Every live process carrying a task marker, by task ARN (for the orphan sweep)."""
    out: dict[str, list[psutil.Process]] = {}
    me = os.getpid()
    for ps in psutil.process_iter():
        if ps.pid == me:
            continue
        marker = _marker_of(ps)
        if marker:
            try:
                if ps.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            out.setdefault(marker, []).append(ps)
    return out


def signal_all(processes: Iterable[psutil.Process], pgids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each process group in ``pgids`` and to each listed process."""
    for pgid in set(pgids):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for ps in processes:
        try:
            ps.send_signal(sig)
        except psutil.Error:
            pass


def cap_log(path: str, limit: int) -> bool:
    """Rotate ``path`` to ``path.1`` (copy, then truncate in place) once it exceeds ``limit``.

    The task keeps writing through its O_APPEND descriptor, so truncating in place is safe; the
    file can exceed ``limit`` by what the task writes between two agent passes.
    """
    try:
        if os.path.getsize(path) <= limit:
            return False
        shutil.copyfile(path, path + ".1")
        os.chmod(path + ".1", 0o600)
        os.truncate(path, 0)
        return True
    except OSError as e:
        log.warning("could not rotate %s: %s", path, e)
        return False


__all__ = [
    "MARKER",
    "WRAPPER",
    "alive",
    "cap_log",
    "marked_processes",
    "read_exit",
    "signal_all",
    "task_processes",
]
