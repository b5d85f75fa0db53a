"""Where a training step ends, for both frontends.

The lazy device ends a step at each ``mark_step``.  Compile mode has no such call: a step ends when
a compiled graph that already ran in the current step runs again (the forward graph of the next
iteration), so forward, backward and optimizer graphs of one iteration make one step.  A step that
calls one compiled graph twice is counted as two.

Each step end runs :func:`kiln.metrics.step_done` (step count and time, observe hooks), then the
``KILN_MAX_STEPS`` stop.
"""

from __future__ import annotations

from kiln import metrics
from kiln.config import config
from kiln.runtime.compiler import stop_after_max_steps

_ran: set[int] = set()  # ids of the compiled graphs that ran in the current step


def graph_run(key: object) -> None:
    """Compile mode: the graph identified by ``key`` is about to run."""
    k = id(key)
    if k in _ran:
        _ran.clear()
        metrics.step_done()
    _ran.add(k)


def lazy_step_end(steps: int) -> None:
    """Lazy device: ``mark_step`` number ``steps`` finished its graph."""
    metrics.step_done()
    if config.max_steps and steps >= config.max_steps:
        stop_after_max_steps()
