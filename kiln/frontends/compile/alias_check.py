"""The first run of a Kiln graph without AOTAutograd's custom-op aliasing check, where the check
cannot fire.

AOTAutograd runs each compiled function's first call under a Python dispatch mode
(``_AnalyzeCustomOpInputOutputMode``, ``torch._functorch.config.check_custom_op_aliasing``) that
warns when a custom op claiming to be functional returns an alias of an input.  It inspects only
ops outside the built-in namespaces (``aten``, ``prim``, ``prims``, the c10d ones, ``onednn``);
for every other op it calls the op and returns.  But every op of the run still passes through
Python: in Llama's warm first step (the graphs loaded from the cache) that was 0.16 s of 1.66 s.

A Kiln graph states every op it runs: its kernels (no dispatch at all), ATen ops, Kiln's own
ops (``kiln`` namespace records, whose reference implementations call ATen) and opaque nodes,
which name their operator.  Where all of them are built-in, the check has nothing to look at, and
:func:`first_run` runs the graph with that one mode taken off the mode stack for the call.  A
graph with any other op (a user's custom op, also one Kiln passed through opaquely) runs under
it as AOTAutograd set it up, so its warning still comes.  Any other mode on top (a user's) is left
alone: then the graph runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from kiln import metrics
from kiln.ir.graph import Graph
from kiln.ir.ops import OPS, opaque_target, packet_of

try:  # AOTAutograd's checking mode (torch 2.13; absent elsewhere: nothing to skip)
    from torch._functorch._aot_autograd.runtime_wrappers import (
        _AnalyzeCustomOpInputOutputMode as _CHECK_MODE,
    )
except ImportError:  # pragma: no cover - other torch releases
    _CHECK_MODE = None

# Namespaces the check never inspects (runtime_wrappers.py: is_builtin and its exclusions), and
# Kiln's own op records
_UNCHECKED = frozenset({"aten", "prim", "prims", "_c10d_functional", "c10d", "onednn", "kiln"})
# Graph nodes that dispatch no operator of their own
_STRUCTURAL = frozenset({"input", "scalar", "constant", "getitem", "fused", "output"})


def _namespace(op: str) -> str | None:
    """The operator namespace a node's op dispatches to; None where unknown."""
    if op.startswith("opaque."):
        return opaque_target(op).partition("::")[0]
    d = OPS.get(packet_of(op))
    return None if d is None else d.namespace


def builtin_only(g: Graph) -> bool:
    """Whether every op the graph runs is one the aliasing check never inspects."""
    for n in g.nodes:
        if n.op in _STRUCTURAL:
            continue
        if _namespace(n.op) not in _UNCHECKED:
            return False
    return True


def first_run(g: Graph, run: Callable[[list], Any], args: list) -> Any:
    """``run(args)`` for the graph's first call: without the checking mode where it is the top
    mode and the graph runs only ops it never inspects; else as it is."""
    checking = _CHECK_MODE is not None and isinstance(_get_current_dispatch_mode(), _CHECK_MODE)
    if checking and builtin_only(g):
        metrics.incr("aot_alias_checks_skipped")
        with _pop_mode_temporarily():
            return run(args)
    return run(args)
