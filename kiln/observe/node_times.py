"""Where a compiled graph's time goes, node by node, as the native launcher runs it.

    with kiln.observe.node_times() as times:
        for _ in range(10):
            step()
    print(times.table(steps=10))

While the block runs, the native graph launcher (:mod:`kiln.codegen.cpp.launcher`) times every
instruction of every graph it runs: each generated kernel, each ATen call (GEMMs, views, copies),
each write back into an input, each Python callback.  The graphs run as they always do, on the
launcher, so a kernel's time is its time in a real step (a ``torch.profiler`` trace runs the
graphs on the Python executor instead, whose per-call Python lands inside the kernel ranges).
What the launcher does not run (Dynamo's guards, AOTAutograd's wrappers, eager code between
graphs) is not counted: ``total`` is the graphs' share of the step.

Where graphs do not run on the launcher (``KILN_LAUNCHER=0``, no compiler) nothing is recorded
and :attr:`NodeTimes.native` is False.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kiln.codegen.cpp.executor import set_node_timing, take_node_times


@dataclass
class NodeTimes:
    """Seconds and calls per (kind, name), summed over every graph and run in the block."""

    native: bool = True
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def by_kind(self) -> dict[str, float]:
        kinds: dict[str, float] = collections.defaultdict(float)
        for (kind, _), secs in self.seconds.items():
            kinds[kind] += secs
        return dict(kinds)

    def top(self, n: int = 15) -> list[tuple[str, str, float, int]]:
        """The ``n`` (kind, name) entries with the most time: (kind, name, seconds, calls)."""
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:n]
        return [(kind, name, secs, self.calls[(kind, name)]) for (kind, name), secs in rows]

    def table(self, steps: int = 1, n: int = 15) -> str:
        """The top ``n`` entries as text: ms and calls per step over ``steps`` steps."""
        lines = [f"{'ms/step':>9} {'calls':>6}  kind     name"]
        for kind, name, secs, calls in self.top(n):
            lines.append(f"{secs * 1e3 / steps:9.3f} {calls / steps:6.0f}  {kind:<8} {name}")
        lines.append(f"{self.total * 1e3 / steps:9.3f} {'':>6}  total (graphs run by the launcher)")
        return "\n".join(lines)


@contextmanager
def node_times() -> Iterator[NodeTimes]:
    """Time every node the native launcher runs inside the block; the result fills on exit."""
    result = NodeTimes(native=set_node_timing(True))
    take_node_times()  # drop anything recorded before the block
    try:
        yield result
    finally:
        set_node_timing(False)
        for _, kind, name, secs, runs in take_node_times():
            key = (kind, name)
            result.seconds[key] = result.seconds.get(key, 0.0) + secs
            result.calls[key] = result.calls.get(key, 0) + runs
