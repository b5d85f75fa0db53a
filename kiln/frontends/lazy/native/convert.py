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
from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType
from kiln.ir.ops import Category, fresh_buffer
from kiln.lowering.aten import op_name
from kiln.runtime.writebacks import Update, add_writebacks

_MEMORY_FORMATS = (
    torch.contiguous_format,
    torch.preserve_format,
    torch.channels_last,
    torch.channels_last_3d,
)
_LAYOUTS = (torch.strided,)

INPUT = -1
SCALAR = -2
SEED = "kiln_seed"  # the op of the random seed's marker recipe (``rng.py``)


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
    if kind == 5:  # a tensor list: node inputs v[0] .. v[0] + v[1] - 1, as a tuple
        return tuple(In(v[0] + i) for i in range(v[1]))
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
        types = tuple(
            None if s is None else TensorType(tuple(s), d) for s, d in zip(shapes, dtypes)
        )
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
    b = GraphBuilder()
    nodes = b.nodes
    n_inputs = 0
    seed_node = None
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
            if t.op == SEED:
                # the step's seed: the marker's input is its 0-dim int64 value.  The first
                # marker (recorded behind the trace's first random node) becomes the graph's
                # seed input, moved before that node below; a later one is never used.
                index = nodes[ins[-1]].kwarg("index")
                kw = (("index", index), ("role", "seed"))
                nodes.append(Node("scalar", kwargs=kw, types=(TensorType((), None, "int"),)))
                if seed_node is None:
                    seed_node = len(nodes) - 1
                continue
            if t.fallback is not None:
                metrics.fallback(t.fallback)
            nodes.append(Node(t.op, tuple(ins), t.args, t.kwargs, t.types))
    outs = _writebacks(b, list(cut.outputs), list(cut.writes))
    if seed_node is not None:
        first = max(i for i in range(seed_node) if nodes[i].category is Category.RANDOM)
        nodes, outs = _move(nodes, outs, seed_node, first)
        seed_node = first
    return _prune(nodes, outs, seed_node)


def _move(nodes: list[Node], outs: list[int], src: int, dst: int) -> tuple[list[Node], list[int]]:
    """Node ``src`` moved to position ``dst`` (< ``src``, ``src`` with no inputs), the nodes in
    between shifted by one, every reference renumbered."""
    new_id = list(range(len(nodes)))
    for i in range(dst, src):
        new_id[i] = i + 1
    new_id[src] = dst
    moved = nodes[:dst] + [nodes[src]] + nodes[dst:src] + nodes[src + 1 :]
    moved = [
        n if not n.inputs else n.with_(inputs=tuple(new_id[j] for j in n.inputs)) for n in moved
    ]
    return moved, [new_id[o] for o in outs]


def _writebacks(b: GraphBuilder, outs: list[int], writes: list[int]) -> list[int]:
    """The graph's outputs with write-backs: a storage that came into the trace as graph input
    ``writes[k]`` (>= 0) and got a freshly computed value ``outs[k]`` gets a ``writeback`` of it
    into that input's buffer, so that the buffer (a parameter's, an optimizer state's) keeps its
    address and the kernel computing the value can write it there (:mod:`kiln.runtime.writebacks`,
    the memory plan).  Not when another output may alias that input (an input returned as is, or
    a view of it: it must keep the old value), nor for a source that may alias an input or a type
    that differs (``add_writebacks``): then the storage takes the result as a new buffer."""
    nodes = b.nodes
    roots: list[frozenset[int]] = []  # the graph inputs whose buffer each node's value may be
    for i, n in enumerate(nodes):
        if n.op == "input":
            roots.append(frozenset((i,)))
        elif n.op == "scalar" or fresh_buffer(n.op, n.category):
            roots.append(frozenset())
        else:
            r: frozenset[int] = frozenset()
            for j in n.inputs:
                r |= roots[j]
            roots.append(r)
    ok = [
        w >= 0 and not roots[o] and nodes[o].types == nodes[w].types for o, w in zip(outs, writes)
    ]
    kept: set[int] = set()  # inputs some plain output may alias
    for o, good in zip(outs, ok):
        if not good:
            kept |= roots[o]
    updates: list[Update] = []
    where: list[int] = []
    for k, (o, w) in enumerate(zip(outs, writes)):
        if ok[k] and w not in kept:
            updates.append(Update(w, o, True))
            where.append(k)
    outs = list(outs)
    for k, wb in zip(where, add_writebacks(b, updates, clone_aliased=False)):
        if wb is not None:
            outs[k] = wb
    return outs


def _prune(nodes: list[Node], outs: list[int], seed_node: int | None = None) -> Converted:
    graph, picks = prune_nodes(nodes, outs, seed_node)  # the seed kept when a random node is
    return Converted(graph, picks)
