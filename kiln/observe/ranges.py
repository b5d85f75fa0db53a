"""Kiln's generated kernels and ATen fallbacks as named ranges in ``torch.profiler`` traces.

The C++ executor runs a graph as one generated Python function (``Executor.source``).  While a
profiler records, the executor runs a second copy of that function instead (through the hook
``kiln.metrics.profiled_runner``, set when this module is imported), built here once per executor: the same source, executed in a namespace where each generated kernel call is wrapped in
a ``kiln::kernel <name>`` range and each opaque node (an op Kiln fell back to ATen for) in a
``kiln::fallback <op>`` range.  Without a profiler nothing here runs: the executor checks
``torch.autograd.profiler._is_profiler_enabled`` (a module attribute) and calls its plain function.

Ranges are ``torch._C._profiler._RecordFunctionFast`` (category ``cpu_op``, ~0.8 us each while
recording), the ones ``torch.profiler.record_function`` would add cost ~6 us.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch._C._profiler import _RecordFunctionFast

from kiln import metrics
from kiln.ir.ops import opaque_target

KERNEL_PREFIX = "kiln::kernel "
FALLBACK_PREFIX = "kiln::fallback "
GRAPH_PREFIX = "kiln::graph "


def _ranged(fn: Callable, name: str) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _RecordFunctionFast(name):
            return fn(*args, **kwargs)

    return call


def instrument(namespace: dict[str, Any], ops: Sequence[str]) -> dict[str, Any]:
    """A copy of an executor's namespace with kernel and fallback calls wrapped in ranges.

    ``ops[i]`` is the op of graph node ``i``; the generated source calls node ``i`` as ``F{i}``
    (a prepared call: generated kernel or ATen) or ``OP{i}`` (an ATen op called inline).
    """
    ns = dict(namespace)
    for key, value in namespace.items():
        if key[:1] == "F" and key[1:].isdigit():
            i = int(key[1:])
        elif key[:2] == "OP" and key[2:].isdigit():
            i = int(key[2:])
        else:
            continue
        kernel = getattr(value, "kiln_kernel", None)
        if kernel is not None:
            ns[key] = _ranged(value, KERNEL_PREFIX + kernel)
        elif ops[i].startswith("opaque."):
            ns[key] = _ranged(value, FALLBACK_PREFIX + opaque_target(ops[i]))
    return ns


def profiled(executor: Any) -> Callable[[Sequence[Any]], list[Any]]:
    """The executor's graph function with named ranges (built on first use, then kept)."""
    run = getattr(executor, "_kiln_profiled", None)
    if run is None:
        ns = instrument(executor.namespace, [n.op for n in executor.graph.nodes])
        code = compile(executor.source, f"<kiln graph {executor.graph.hash} profiled>", "exec")
        exec(code, ns)  # noqa: S102 - the executor's own generated source
        run = executor._kiln_profiled = ns["run"]
    return run


metrics.profiled_runner = profiled
