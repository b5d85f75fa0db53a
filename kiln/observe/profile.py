"""A ``torch.profiler`` session over a few of Kiln's training steps (``kiln profile``).

    KILN_PROFILE=trace.json KILN_PROFILE_STEPS=3 python train.py
    kiln profile --steps 3 -o trace.json -- python train.py      # the same, then a summary

The session starts when Kiln is imported (``profile_skip`` = 0: the first step, with its
compiles, is recorded) or after ``profile_skip`` steps, marks every Kiln step boundary with
``profiler.step()`` (ranges ``ProfilerStep#N``), and after ``profile_steps`` steps writes a
Chrome trace (open it in Perfetto or chrome://tracing; TensorBoard's profiler plugin reads it from
a ``*.pt.trace.json`` file).  A process that exits earlier writes what it recorded at exit.

Kiln's stages appear as ranges: ``kiln::record`` (the lazy device recording a step),
``kiln::mark_step`` / ``kiln::sync <reason>`` (cutting it), ``kiln::settle_heap`` (its one-off
garbage collection after a new graph), ``kiln::compile <graph>``,
``kiln::graph <graph>`` (running a compiled graph), ``kiln::kernel <name>`` (each generated
kernel) and ``kiln::fallback <op>`` (ops Kiln left to ATen), beside PyTorch's own ``aten::`` ops.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from kiln import metrics


class ProfileSession:
    def __init__(self, path: str, steps: int, skip: int = 0) -> None:
        self.path = Path(path)
        self.steps = steps
        self.skip = skip
        self.done = False
        with warnings.catch_warnings():  # "won't be using warmup": intended, the first step counts
            warnings.simplefilter("ignore")
            schedule = torch.profiler.schedule(wait=skip, warmup=0, active=steps, repeat=1)
        self.prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=schedule,
            on_trace_ready=self._export,
        )

    def start(self) -> None:
        self.prof.start()
        atexit.register(self.finish)

    def on_step(self) -> None:
        if self.prof is None:  # finished (at exit)
            return
        if not self.done:
            self.prof.step()
        elif self.prof is not None:
            self._stop()

    def _export(self, prof: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kiln-trace-", suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.done = True
        print(f"[kiln] profile: wrote a Chrome trace to {self.path}", file=sys.stderr)

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()  # writes the trace if still recording

    def finish(self) -> None:
        """At exit: write what was recorded, if the steps did not all run (compile mode's last
        step, still open, ended first: :func:`kiln.metrics.run_ending`)."""
        metrics.run_ending()
        self._stop()


_session: ProfileSession | None = None


def start_from_config() -> ProfileSession:
    from kiln.config import config

    global _session
    path = config.profile
    rank = os.environ.get("RANK")
    if rank not in (None, "", "0"):  # one trace per worker of a distributed job
        path = f"{path}.rank{rank}"
    _session = ProfileSession(path, config.profile_steps, config.profile_skip)
    _session.start()
    return _session


def on_step() -> None:
    if _session is not None:
        _session.on_step()
