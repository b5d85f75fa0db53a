"""The step logic both frontends share: where a step ends, ``KILN_MAX_STEPS``, call-site names and
recompile reasons.

The lazy device ends a step at each ``mark_step``.  Compile mode has no such call: a step ends when
a compiled graph that already ran in the current step runs again (the forward graph of the next
iteration), so forward, backward and optimizer graphs of one iteration make one step; the run's last
step ends when the run does (:func:`kiln.metrics.run_ending`).  A step that calls one compiled graph
twice is counted as two.

Each step end runs :func:`kiln.metrics.step_done` (step count and time, observe hooks), then the
``KILN_MAX_STEPS`` stop.

A *call site* is the user's line of code a graph comes from (the first frame outside Kiln and
PyTorch), ``"lazy:train.py:42"`` or ``"compile:model.py:17"``.  :class:`Recompiles` remembers the
last graph of each site and counts a new one there as a recompile, with the reason.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kiln import metrics
from kiln.config import config

_ran: set[int] = set()  # ids of the compiled graphs that ran in the current step
_compiled_steps = 0  # steps compile mode has ended in this process


def graph_run(key: object) -> None:
    """Compile mode: the graph identified by ``key`` is about to run."""
    global _compiled_steps
    k = id(key)
    if k in _ran:
        _ran.clear()
        _compiled_steps += 1
        step_end(_compiled_steps)
    elif not _ran:  # the first graph of a step (and the run's end counts the step if it is open)
        metrics.step_began(time.perf_counter())  # the first step's start if none was noted
        metrics.end_open_step(_end_open_step)
    _ran.add(k)


def _end_open_step() -> None:
    """The run ends: a compiled step whose graphs ran is a step (its end was not seen)."""
    global _compiled_steps
    if _ran:
        _ran.clear()
        _compiled_steps += 1
        metrics.step_done()  # no KILN_MAX_STEPS stop: the run is ending anyway


def step_end(steps: int) -> None:
    """Step number ``steps`` of this process ended (lazy: its ``mark_step`` ran its graph)."""
    metrics.step_done()
    if config.max_steps and steps >= config.max_steps:
        stop_after_max_steps()


lazy_step_end = step_end


def stop_after_max_steps() -> None:
    """``KILN_MAX_STEPS`` (set by ``kiln precompile`` / ``kiln explain``): end the process cleanly
    once that many steps have run; the compile cache already holds every graph they needed."""
    print(
        f"[kiln] stopping after {config.max_steps} steps (KILN_MAX_STEPS): "
        f"{metrics.get('graphs_compiled')} graphs compiled, "
        f"{metrics.get('cache_hits_disk')} loaded from the disk cache",
        file=sys.stderr,
    )
    raise SystemExit(0)


# -- call sites ---------------------------------------------------------------------------------
_KILN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(
    d + os.sep for d in (_KILN_DIR, os.path.dirname(os.path.abspath(torch.__file__ or "")))
)
_FRAME_LINE = re.compile(r'File "(.+)", line (\d+)')


def call_site(frontend: str, frames: Iterable[tuple[str, int]]) -> str | None:
    """``"<frontend>:<file>:<line>"`` of the first of ``frames`` (innermost first) that is the
    user's code, not Kiln's or PyTorch's; None when there is none."""
    for filename, line in frames:
        if not os.path.abspath(filename).startswith(_LIBRARY_DIRS):
            return f"{frontend}:{filename}:{line}"
    return None


def python_frames() -> Iterable[tuple[str, int]]:
    """The calling Python stack, innermost first (walked lazily)."""
    f = sys._getframe(1)
    while f is not None:
        yield f.f_code.co_filename, f.f_lineno
        f = f.f_back


def stack_trace_frames(text: str) -> list[tuple[str, int]]:
    """The frames of a formatted Python traceback (``node.meta["stack_trace"]``), innermost
    first."""
    return [(f, int(line)) for f, line in reversed(_FRAME_LINE.findall(text))]


# -- recompiles ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Signature:
    """What identifies a call site's graph: one entry per input (its type), and optionally the
    graph itself (its hash and size) when a change of structure alone counts as a recompile."""

    inputs: tuple
    graph: str = ""
    nodes: int = 0


def recompile_reason(prev: Signature, new: Signature) -> str | None:
    """Why a call site got a new graph, or None when it is the same one."""
    if len(prev.inputs) != len(new.inputs):
        return f"number of inputs changed {len(prev.inputs)} -> {len(new.inputs)}"
    for k, (a, b) in enumerate(zip(prev.inputs, new.inputs)):
        if a != b:
            return f"input {k} changed {a} -> {b}"
    if prev.graph != new.graph:
        return f"graph structure changed ({prev.nodes} -> {new.nodes} nodes)"
    return None


def _shape_dtype(x: Any) -> tuple[Any, Any]:
    """An input's shape and dtype in either frontend's signature (a ``TensorType``, a ``(shape,
    dtype)`` pair, a type name)."""
    if isinstance(x, tuple) and len(x) == 2:
        return x
    return getattr(x, "shape", x), getattr(x, "dtype", None)


def recompile_advice(site: str, prev: Signature, new: Signature) -> str:
    """What to do about a recompile at ``site`` from ``prev`` to ``new``: the warning's second
    sentence."""
    changed = [(a, b) for a, b in zip(prev.inputs, new.inputs) if a != b]
    if len(prev.inputs) == len(new.inputs) and changed:
        shapes = any(_shape_dtype(a)[0] != _shape_dtype(b)[0] for a, b in changed)
        dtypes = any(_shape_dtype(a)[1] != _shape_dtype(b)[1] for a, b in changed)
        if dtypes and not shapes:
            return "Each new dtype is a new graph: keep the inputs of one call site in one dtype."
        return (
            "Each new shape or dtype is a new graph: pad inputs to a few fixed sizes or mark the "
            "dimension dynamic."
        )
    variants = (
        "The code here made another graph than before (a branch on data, a train/eval switch, "
        "another number of tensors): each variant is its own graph, compiled once and reused after"
    )
    if site.startswith("lazy:"):
        return (
            f"{variants}; a count that keeps growing means the graph is cut at another place "
            "each time: call kiln.mark_step() where each step ends."
        )
    return variants + "."


class Recompiles:
    """The last graph run at each call site; a newly compiled, different one is a recompile,
    counted in :mod:`kiln.metrics` with its reason (a warning past ``config.recompile_warn``)."""

    def __init__(self) -> None:
        self._last: dict[str, Signature] = {}

    def seen(self, site: str, sig: Signature, compiled: bool = True) -> None:
        """Graph ``sig`` runs at ``site``; ``compiled``: it was just compiled (or loaded from the
        disk cache), not taken from the memory cache."""
        prev = self._last.get(site)
        self._last[site] = sig
        if prev is None or not compiled:
            return
        reason = recompile_reason(prev, sig)
        if reason is not None:
            metrics.recompile(
                site, reason, config.recompile_warn, recompile_advice(site, prev, sig)
            )

    def clear(self) -> None:
        self._last.clear()
