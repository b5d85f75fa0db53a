"""Readable text form of a graph, one node a line::

graph(%0: f32[4,8], %1: f32[8]) {
  %2 = add.Tensor(%0, %1) : f32[4,8]
  return (%2)
}
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kiln.ir.node import In, Node


class GraphLike(Protocol):
    """What the printer reads of a graph (kiln.ir.graph imports this module, not the reverse)."""

    nodes: Sequence[Node]
    inputs: Sequence[int]
    outputs: Sequence[int]


def _fmt(v: Any, node: Node) -> str:
    if isinstance(v, In):
        return f"%{node.inputs[v.k]}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_fmt(x, node) for x in v)
        return f"[{inner}]"
    return repr(v)


def format_node(i: int, n: Node) -> str:
    types = ", ".join(str(t) for t in n.types)
    if n.op in ("input", "scalar", "constant"):
        return f"%{i} = {n.op}[{n.kwarg('index')}] : {types}"
    parts = [_fmt(a, n) for a in n.args]
    parts += [f"{k}={_fmt(v, n)}" for k, v in n.kwargs]
    return f"%{i} = {n.op}({', '.join(parts)}) : {types}"


def format_graph(g: GraphLike) -> str:
    ins = ", ".join(f"%{i}: {g.nodes[i].types[0]}" for i in g.inputs)
    lines = [f"graph({ins}) {{"]
    for i, n in enumerate(g.nodes):
        if n.op in ("input", "scalar"):
            continue
        lines.append("  " + format_node(i, n))
    lines.append(f"  return ({', '.join(f'%{o}' for o in g.outputs)})")
    lines.append("}")
    return "\n".join(lines)
