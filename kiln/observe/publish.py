"""Each Kiln process publishes a small record of its state for ``kiln ls`` and ``kiln top``.

The record is one JSON file, ``<runtime_dir>/proc-<pid>.json`` (``KILN_RUNTIME_DIR``; default
``$XDG_RUNTIME_DIR/kiln``, else ``/tmp/kiln-<uid>``), written at step boundaries: the first step
at once, then at most once a second (``interval_s``).  A write goes to a temporary file in the same
folder that is renamed over the record (atomic: a reader sees the old or the new record, never a
part), without fsync (a record is live state, not data to keep).  The record is removed at exit;
a process killed before that leaves a stale record, which readers recognize (its pid is gone or
started at another time) and ignore.

Off the rate limit, a step pays one clock read and a comparison.  ``KILN_PUBLISH=0`` turns it off.
A record that cannot be written (permissions, full disk) is reported once as a warning and
publishing stops for the process: training goes on.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from kiln import metrics

FORMAT = 1  # version of the record layout
MAX_GRAPHS = 64  # most recently used graphs listed in a record


class PublishWarning(UserWarning):
    pass


def kiln_version() -> str:
    """The installed distribution's version (importing the ``kiln`` package from here would make
    it import itself through the step hook)."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "source"


def record_path(directory: str | os.PathLike, pid: int) -> Path:
    return Path(directory) / f"proc-{pid}.json"


def ensure_private_dir(directory: str | os.PathLike) -> Path:
    """Create ``directory`` (mode 0700) or check that an existing one is ours and not
    world-writable: records name processes and command lines, other users must not forge or read
    them.  PermissionError naming the problem and the fix otherwise."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"Kiln runtime directory {d} belongs to another user or is writable by others; "
            "point KILN_RUNTIME_DIR at a private directory"
        )
    return d


def _static() -> dict[str, Any]:
    import psutil
    import torch

    proc = psutil.Process()
    env = os.environ
    return {
        "format": FORMAT,
        "pid": proc.pid,
        "create_time": proc.create_time(),
        "host": os.uname().nodename,
        "cmdline": [sys.executable, *sys.argv],
        "kiln_version": kiln_version(),
        "torch_version": torch.__version__,
        "started": time.time(),
        "task": {
            "arn": env.get("CLUSTER_TASK_ARN"),
            "container": env.get("CLUSTER_CONTAINER_NAME"),
        },
        "visible": {
            "neuron_devices": env.get("AWS_NEURON_VISIBLE_DEVICES"),
            "neuron_cores": env.get("NEURON_RT_VISIBLE_CORES"),
            "gpus": env.get("CUDA_VISIBLE_DEVICES") or env.get("NVIDIA_VISIBLE_DEVICES"),
        },
    }


_summaries: dict[tuple[int, str], dict[str, Any]] = {}  # per compiled graph: what never changes


def _graphs() -> list[dict[str, Any]]:
    from kiln.ir.ops import Category
    from kiln.runtime.compiler import executables

    out = []
    for exe in executables()[-MAX_GRAPHS:]:
        key = (id(exe), exe.source_graph_hash)
        summary = _summaries.get(key)
        if summary is None:
            if len(_summaries) > 4 * MAX_GRAPHS:
                _summaries.clear()
            summary = _summaries[key] = {
                "hash": exe.source_graph_hash,
                "nodes": len(exe.graph),
                "backend": exe.info.get("backend", "interpreter"),
                "kernels": len(exe.info.get("kernels", ())),
                "fallbacks": sum(1 for n in exe.graph.nodes if n.category is Category.OPAQUE),
            }
        out.append({**summary, "runs": exe.runs})
    return out


def build_record(static: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """The record now; ``previous`` (the last one written) gives per-step rates."""
    import torch

    snap = metrics.snapshot()
    steps = snap.get("steps", 0)
    step_s = snap.pop("step_s")
    graphs = _graphs()
    executed = snap.get("graphs_executed", 0)
    prev_steps = previous["steps"] if previous else 0
    prev_exec = previous["counters"].get("graphs_executed", 0) if previous else 0
    running = (executed - prev_exec) / (steps - prev_steps) if steps > prev_steps else 0.0
    return {
        **static,
        "updated": time.time(),
        "steps": steps,
        "step_s_last": step_s[-1] if step_s else None,
        "step_s_median": sorted(step_s)[len(step_s) // 2] if step_s else None,
        "graphs_per_step": round(running, 2),
        "counters": {k: v for k, v in snap.items() if isinstance(v, (int, float))},
        "compile_wait_s": metrics.compile_wait_s(snap),
        "graphs": graphs,
        "cpus": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
    }


class Publisher:
    """Writes this process's record at step boundaries, at most once per ``interval_s``."""

    def __init__(self, directory: str, interval_s: float = 1.0) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.path = record_path(self.directory, self.pid)
        self._next = 0.0
        self._static: dict[str, Any] | None = None
        self._last: dict[str, Any] | None = None
        self.failed = False
        self.writes = 0

    def tick(self) -> None:
        """At a step boundary: publish if the last record is older than ``interval_s``."""
        now = time.monotonic()
        if now < self._next or self.failed:
            return
        self._next = now + self.interval_s
        self.write()

    def write(self) -> None:
        if os.getpid() != self.pid:  # a forked child: its own record, not its parent's
            self._reset()
        try:
            if self._static is None:
                ensure_private_dir(self.directory)
                self._static = _static()
                atexit.register(self.remove)
            rec = build_record(self._static, self._last)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".proc-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(rec, f, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self.failed = True
            warnings.warn(
                f"Kiln cannot publish its state to {self.directory} ({exc}); kiln ls and kiln top "
                "will not see this process. Set KILN_RUNTIME_DIR to a writable private directory, "
                "or KILN_PUBLISH=0 to stop trying.",
                PublishWarning,
                stacklevel=2,
            )
            return
        self._last = rec
        self.writes += 1

    def remove(self) -> None:
        """Remove the record (at exit; a forked child leaves its parent's record alone).  Compile
        mode's last step, still open, ends first (:func:`kiln.metrics.run_ending`), and nothing
        is written after: a step ending later in the exit would leave a record behind."""
        metrics.run_ending()
        self._next = float("inf")
        if os.getpid() == self.pid:
            self.path.unlink(missing_ok=True)
