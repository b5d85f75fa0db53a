"""Reference interpreter backend: runs a Kiln graph node by node through the op records' reference
implementations (ATen for ATen ops, :func:`kiln.ir.semantics.call_node`).

It is the semantics every other executor is checked against, and the fallback executor for any
node a code generator does not take.  Values are freed right after their last use.
"""

from __future__ import annotations

from typing import Any, Sequence

from kiln.codegen.base import Backend, register_backend
from kiln.ir.graph import Graph
from kiln.ir.ops import Category
from kiln.ir.semantics import call_node, last_uses


class Interpreter:
    """A graph, prepared once, run many times."""

    def __init__(self, g: Graph) -> None:
        self.graph = g
        self.free = last_uses(g)
        self.has_random = any(n.category is Category.RANDOM for n in g.nodes)

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        g = self.graph
        vals: list[Any] = [None] * len(g.nodes)
        for i, n in enumerate(g.nodes):
            op = n.op
            if op == "input" or op == "scalar":
                vals[i] = inputs[n.kwargs[0][1]]
            elif op == "constant":
                vals[i] = g.constants[n.kwargs[0][1]]
            else:
                vals[i] = call_node(n, [vals[j] for j in n.inputs])
            for j in self.free[i]:
                vals[j] = None
        return [vals[o] for o in g.outputs]


def build(g: Graph) -> tuple[Interpreter, dict]:
    return Interpreter(g), {"backend": "interpreter"}


register_backend(Backend("interpreter", build))  # runs graphs as optimized, un-fused
