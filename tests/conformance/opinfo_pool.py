"""The OpInfo sweep in worker processes: the ops run side by side, and a process abort is a failure.

``Sweep(tasks)`` starts ``KILN_TEST_OPINFO_WORKERS`` worker processes (default: the usable CPUs,
at most 4; ``0`` runs every op in this process) and hands them the ``(mode, op id)`` tasks in
order, one at a time; ``result(mode, name)`` waits for that op's outcomes, keeping the workers
busy with the next tasks meanwhile.  Each worker runs :func:`opinfo_check.op_outcomes` on its
tasks one after the other, with the Kiln kernel cache of the caller (shared safely: builds are
locked per kernel and land atomically).  A worker that dies (a C++ abort, a signal) fails the op
it was running with its exit status, and a fresh worker takes the next task: one abort never
ends the sweep, and is never mistaken for a pass.  An op still running after
``KILN_TEST_OPINFO_TIMEOUT`` seconds (default 600) fails the same way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from opinfo_runner import Outcome

Task = tuple[str, str]  # (mode, op id)


def default_workers() -> int:
    env = os.environ.get("KILN_TEST_OPINFO_WORKERS", "")
    if env:
        return int(env)
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _worker(conn: Connection, cache_dir: str) -> None:
    """A worker process: receives tasks until ``None``, sends back ``(task, outcomes)``."""
    import kiln

    kiln.config.update(cache_dir=cache_dir)
    while True:
        task = conn.recv()
        if task is None:
            return
        mode, name = task
        if mode == "_abort":  # the pool's own test: a worker dying mid-task
            os.abort()
        from opinfo_check import op_outcomes  # (op_db: seconds to import, once)

        try:
            out = op_outcomes(name, mode)
        except Exception as e:  # noqa: BLE001 - op_outcomes should not raise: reported as a fail
            fail = Outcome("fail", f"the sweep itself raised {type(e).__name__}: {e}")
            out = {"fwd": fail, "grad": fail}
        conn.send((task, out))


class _Proc:
    def __init__(self, ctx: Any, cache_dir: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, cache_dir), daemon=True)
        self.proc.start()
        child.close()
        self.task: Task | None = None
        self.since = 0.0

    def give(self, task: Task) -> None:
        self.task, self.since = task, time.monotonic()
        self.conn.send(task)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


class Sweep:
    """Outcomes of ``(mode, op id)`` tasks, computed in order by worker processes."""

    def __init__(self, tasks: list[Task], cache_dir: str, workers: int | None = None) -> None:
        self.pending: deque[Task] = deque(dict.fromkeys(tasks))
        self.results: dict[Task, dict[str, Outcome]] = {}
        self.cache_dir = cache_dir
        self.timeout = float(os.environ.get("KILN_TEST_OPINFO_TIMEOUT", "600"))
        n = default_workers() if workers is None else workers
        self.ctx = mp.get_context("spawn")
        self.procs = [_Proc(self.ctx, cache_dir) for _ in range(min(n, len(self.pending)))]

    def result(self, mode: str, name: str) -> dict[str, Outcome]:
        task = (mode, name)
        if task in self.results:
            return self.results.pop(task)
        if not self.procs:  # in this process
            from opinfo_check import op_outcomes

            return op_outcomes(name, mode)
        if task not in self.pending and all(p.task != task for p in self.procs):
            self.pending.appendleft(task)
        while task not in self.results:
            self._pump()
        return self.results.pop(task)

    def _pump(self) -> None:
        """Give idle workers tasks; wait for one result (or a death, or a timeout)."""
        for p in self.procs:
            if p.task is None and self.pending:
                p.give(self.pending.popleft())
        busy = [p for p in self.procs if p.task is not None]
        if not busy:
            raise RuntimeError("OpInfo sweep: no task running and the wanted one is not queued")
        left = min(self.timeout - (time.monotonic() - p.since) for p in busy)
        ready = wait([p.conn for p in busy], timeout=max(left, 0.0))
        for p in busy:
            if p.conn in ready:
                try:
                    task, out = p.conn.recv()
                except (EOFError, OSError):
                    p.proc.join(timeout=10)
                    self._replace(p, f"the worker process died ({_died(p.proc.exitcode)})")
                    continue
                self.results[task] = out
                p.task = None
            elif time.monotonic() - p.since > self.timeout:
                self._replace(p, f"still running after {self.timeout:.0f} s (worker killed)")

    def _replace(self, p: _Proc, why: str) -> None:
        fail = Outcome("fail", f"{why} while running this op")
        assert p.task is not None
        self.results[p.task] = {"fwd": fail, "grad": fail}
        p.stop(kill=True)
        self.procs[self.procs.index(p)] = _Proc(self.ctx, self.cache_dir)

    def close(self) -> None:
        for p in self.procs:
            p.stop(kill=p.task is not None)
        self.procs = []
