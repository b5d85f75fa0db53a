"""Reference interpreter backend: runs a Kiln graph node by node through the op records' reference
implementations (ATen for ATen ops, :func:`kiln.ir.semantics.call_node`).

It is the semantics every other executor is checked against, and the fallback executor for any
node a code generator does not take.  Values are freed right after their last use.  While a
profiler records, each opaque node (an op Kiln fell back to ATen for) runs in a
``kiln::fallback <op>`` range, as in the C++ backend's traces.

With stochastic rounding on (``KILN_STOCHASTIC_ROUNDING=1``), an elementwise node with bf16 / fp16
results runs on float32 copies of its inputs and each result is rounded stochastically
(:mod:`kiln.precision.aten_sr`, the rule the C++ backend applies to the nodes it runs through ATen;
the rounding itself is :mod:`kiln.precision`'s generated cast kernel).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kiln import metrics
from kiln.codegen.base import Backend, register_backend
from kiln.ir.graph import Graph
from kiln.ir.ops import Category, opaque_target
from kiln.ir.semantics import call_node, last_uses
from kiln.precision import rounding


class Interpreter:
    """A graph, prepared once, run many times."""

    def __init__(self, g: Graph) -> None:
        self.graph = g
        self.free = last_uses(g)
        self.has_random = any(n.category is Category.RANDOM for n in g.nodes)
        # node id -> its profiler range name, for ops left to ATen
        self.fallbacks = {
            i: "kiln::fallback " + opaque_target(n.op)
            for i, n in enumerate(g.nodes)
            if n.op.startswith("opaque.")
        }
        # node id -> its call, for nodes that do not run as call_node does (stochastic rounding)
        self.calls: dict[int, Callable[[list[Any]], Any]] = (
            _stochastic_calls(g) if rounding.enabled() else {}
        )

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        if self.fallbacks and metrics.profiling():
            return self._run(inputs, self.fallbacks)
        return self._run(inputs, {})

    def _run(self, inputs: Sequence[Any], ranges: dict[int, str]) -> list[Any]:
        g = self.graph
        vals: list[Any] = [None] * len(g.nodes)
        for i, n in enumerate(g.nodes):
            op = n.op
            if op == "input" or op == "scalar":
                vals[i] = inputs[n.kwargs[0][1]]
            elif op == "constant":
                vals[i] = g.constants[n.kwargs[0][1]]
            elif i in ranges:
                with metrics.span(ranges[i]):
                    vals[i] = call_node(n, [vals[j] for j in n.inputs])
            elif i in self.calls:
                vals[i] = self.calls[i]([vals[j] for j in n.inputs])
            else:
                vals[i] = call_node(n, [vals[j] for j in n.inputs])
            for j in self.free[i]:
                vals[j] = None
        return [vals[o] for o in g.outputs]


def _stochastic_calls(g: Graph) -> dict[int, Callable[[list[Any]], Any]]:
    """Calls that round the bf16 / fp16 results of elementwise nodes stochastically."""
    from kiln.precision.aten_sr import in_float, sr_call, wants_sr
    from kiln.precision.kernels import cast_fn

    casts = {"bf16": cast_fn("kp_cast_bf16_sr"), "f16": cast_fn("kp_cast_fp16_sr")}
    calls: dict[int, Callable[[list[Any]], Any]] = {}
    for i, n in enumerate(g.nodes):
        if wants_sr(n):
            run = sr_call(n, lambda ins, f=in_float(n): call_node(f, ins), casts)
            if len(n.types) == 1:  # one value (maybe a list of tensors)
                calls[i] = lambda ins, run=run: run(ins)[0]
            else:
                calls[i] = lambda ins, run=run: tuple(run(ins))
    return calls


def build(g: Graph) -> tuple[Interpreter, dict]:
    return Interpreter(g), {"backend": "interpreter"}


register_backend(Backend("interpreter", build))  # runs graphs as optimized, un-fused
