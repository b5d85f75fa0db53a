"""Compile mode's compile time as the user waits for it, in :mod:`kiln.metrics`.

Kiln's own ``compile_s`` / ``load_s`` are a small part of a torch.compile'd step's first call:
Dynamo traces the frame and AOTAutograd traces and partitions the graph around Kiln's backend
(a tiny MLP's training step: 2.3 s of frame compiles, 0.07 s of them Kiln's).  Each step end adds
the frame-compile seconds Dynamo counted since the last one (``entire_frame_compile`` and
``entire_backward_compile``, its own totals), with the part of them Kiln's backend spent in its
compiles and cache loads, so that :func:`kiln.metrics.compile_wait_s` counts every second once.
The first step begins where the first frame compile that reached Kiln began.

Needs: :func:`frame_began` called as Kiln's backend starts on a graph, :func:`backend_call`
around the backend's work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kiln import metrics

_seen = [0.0, 0.0]  # Dynamo's frame-compile total, and Kiln's nested compile time, at the last note
_nested = [0.0]  # Kiln's compile_s + load_s spent inside backend calls so far


def _frames_total() -> float:
    return float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0))


def note() -> None:
    """A step ends (a :func:`kiln.metrics.before_step_end` hook): add its frame-compile time."""
    total = _frames_total()
    # torch._dynamo.reset() zeroes Dynamo's totals: then all of the new total is new
    frames = total - _seen[0] if total >= _seen[0] else total
    nested = _nested[0] - _seen[1]
    _seen[0], _seen[1] = total, _nested[0]
    if frames > 0 or nested > 0:
        # Kiln's part cannot exceed the frames it ran in (Dynamo's clock and ours differ a little)
        metrics.frame_compiled(frames, min(nested, frames))


def frame_began() -> None:
    """Kiln's backend got a graph: the first step began where Dynamo began compiling its frame."""
    metrics.before_step_end(note)
    ctx = torch._dynamo.utils.get_metrics_context()
    started_ns = getattr(ctx, "_start_time_ns", 0) if ctx.in_progress() else 0
    now = time.perf_counter()
    ago = (time.time_ns() - started_ns) / 1e9 if started_ns else 0.0
    metrics.step_began(now - max(ago, 0.0))


@contextmanager
def backend_call() -> Iterator[None]:
    """Around Kiln's backend's work on one graph: its compiles and loads are nested in a frame."""
    before = metrics.snapshot()
    try:
        yield
    finally:
        after = metrics.snapshot()
        _nested[0] += after["compile_s"] + after["load_s"] - before["compile_s"] - before["load_s"]
