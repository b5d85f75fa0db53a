"""A natively recorded trace -> Kiln's IR :class:`~kiln.ir.graph.Graph`.

The recorder (``recorder.cpp``) keeps, per node, a recipe id and its input node ids; a recipe
holds the ATen overload, the node template as ``__torch_dispatch__`` would pass its arguments
(``(kind, value)`` per argument: a constant, or the k-th node input) and the output geometry.
This builds the same nodes the Python recorder builds for the same calls (``lower_call``: Kiln
op name, ``In(k)`` markers, lists as tuples; opaque ops counted as fallbacks), then keeps what the
outputs need, numbering inputs in order of first use, as ``trace._prune_uncached`` does.  It runs
once per new graph: a steady step is recognised by the recorder and its conversion reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln import metrics
from kiln.frontends.lazy.trace import prune_nodes
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.lowering.aten import op_name

_MEMORY_FORMATS = (
    torch.contiguous_format,
    torch.preserve_format,
    torch.channels_last,
    torch.channels_last_3d,
)
_LAYOUTS = (torch.strided,)

INPUT = -1
SCALAR = -2


@dataclass(frozen=True)
class Converted:
    graph: Graph
    picks: list[int]  # graph input k is the cut's value picks[k]


@dataclass(frozen=True)
class _Template:
    op: str
    args: tuple
    kwargs: tuple
    types: tuple
    fallback: str | None


_templates: dict[int, _Template] = {}


def _const(kind: int, v: Any) -> Any:
    if kind == 3:
        return _MEMORY_FORMATS[v]
    if kind == 4:
        return _LAYOUTS[v]
    if isinstance(v, list):
        return tuple(_const(0, x) for x in v)
    return v


def _arg(item: tuple) -> Any:
    kind, v = item
    return In(v) if kind == 1 else _const(kind, v)


def register(
    rid: int, op: str, args: tuple, kwargs: tuple, types: tuple, fallback: str | None
) -> None:
    """The node template of a recipe the Python fallback made (``fallback.py``)."""
    _templates[rid] = _Template(op, args, kwargs, types, fallback)


def template(mod: Any, rid: int) -> _Template:
    t = _templates.get(rid)
    if t is None:
        qual, overload, args, kwargs, shapes, dtypes, _view, item = mod.recipe_info(rid)
        types = tuple(TensorType(tuple(s), d) for s, d in zip(shapes, dtypes))
        if item >= 0:  # one output of a multi-output node, as the Python fallback builds it
            t = _templates[rid] = _Template("getitem", (In(0), item), (), types, None)
            return t
        packet = getattr(torch.ops.aten, qual.split("::")[1])
        func = getattr(packet, overload or "default")
        name, real = op_name(func)
        t = _templates[rid] = _Template(
            name,
            tuple(_arg(a) for a in args),
            tuple((k, _arg(a)) for k, a in kwargs),
            types,
            None if real else qual.split("::")[1],
        )
    return t


def convert(mod: Any, cut: Any) -> Converted:
    """The Kiln graph of a cut trace (``mod``: the recorder extension)."""
    raw = cut.nodes()
    values = cut.values()
    nodes: list[Node] = []
    n_inputs = 0
    for head, ins in raw:
        if head == INPUT:
            v = values[n_inputs]
            kw = (("index", n_inputs),)
            nodes.append(Node("input", kwargs=kw, types=(TensorType(tuple(v.shape), v.dtype),)))
            n_inputs += 1
        elif head == SCALAR:
            kw = (("index", n_inputs),)
            nodes.append(Node("scalar", kwargs=kw, types=(TensorType((), None, "float"),)))
            n_inputs += 1
        else:
            t = template(mod, head)
            if t.fallback is not None:
                metrics.fallback(t.fallback)
            nodes.append(Node(t.op, tuple(ins), t.args, t.kwargs, t.types))
    return _prune(nodes, list(cut.outputs))


def _prune(nodes: list[Node], outs: list[int]) -> Converted:
    graph, picks = prune_nodes(nodes, outs)  # (no random nodes yet: no seed input)
    return Converted(graph, picks)
