"""Read an ``expand``'s source directly in the elementwise ops that read the expanded value.

An elementwise op broadcasts its operands itself, so an operand ``expand(v, S)`` whose op
already has the shape ``S`` (another operand is ``S``-shaped) can be ``v``; an op whose only tensor
operand is ``expand(v, S)`` computes on ``v`` and the expand moves below it::

    %e = expand.default(%v, [4, 64, 128])      : f32[4,64,128]    %v: f32[4,64,1]
    %d = div.Scalar(%e, 128)                   : f32[4,64,128]
    %m = mul.Tensor(%d, %x)                    : f32[4,64,128]    %x: f32[4,64,128]
  becomes
    %d = div.Scalar(%v, 128)                   : f32[4,64,1]
    %e = expand.default(%d, [4, 64, 128])      : f32[4,64,128]
    %m = mul.Tensor(%v', %x)  (reading %d)     : f32[4,64,128]

The decomposed RMS norm backward expands its per-row term before dividing it by the row length;
without the expand in the way, the fuser puts the term and the elementwise gradient into the
row-sum kernel that computes it (:mod:`kiln.passes.fuse`'s rows epilogue) instead of a kernel of
their own reading the expanded value through its strides.  Each row value is also divided once
instead of once per element.

Needs: a typed graph.  Guarantees: same output values, shapes and dtypes (an elementwise op on
the unexpanded value computes, per element, what it computed on its broadcast copy); only
``expand`` nodes whose source has the expanded rank, sizes equal or 1, are looked through; only
elementwise math ops (no in-place, random or layout ops); no rewrite under mutation; graph outputs
keep their shape (an op that is a graph output is not shrunk).  Expands left unread are dropped.
"""

from __future__ import annotations

from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType
from kiln.ir.ops import Category, category, packet_of
from kiln.passes._util import GraphFacts
from kiln.passes.dce import dce

EXPAND = "expand.default"
_NOT_MATH = frozenset({"clone", "copy", "fill", "zero", "_to_copy", "to_copy"})
_KWARGS = frozenset({"alpha", "approximate", "rounding_mode"})


def _is_math(n: Node) -> bool:
    try:
        if category(n.op) is not Category.ELEMENTWISE:
            return False
    except KeyError:
        return False
    p = packet_of(n.op)
    if p in _NOT_MATH or p.startswith("_foreach") or p.endswith("_") or len(n.types) != 1:
        return False
    if n.type is None or any(k not in _KWARGS or isinstance(v, In) for k, v in n.kwargs):
        return False
    return all(isinstance(a, (In, int, float, bool, str)) or a is None for a in n.args)


def _source(b: GraphBuilder, j: int) -> int | None:
    """The source of ``expand`` node ``j`` when it only adds broadcast sizes (same rank)."""
    e = b.nodes[j]
    if e.op != EXPAND or e.type is None or len(e.inputs) != 1 or e.kwargs:
        return None
    if e.args[:1] != (In(0),) or any(isinstance(x, In) for x in e.args[1]):
        return None
    v = b.nodes[e.inputs[0]].types
    vt = v[0] if len(v) == 1 else None
    if vt is None or vt.dtype != e.type.dtype or len(vt.shape) != len(e.type.shape):
        return None
    if any(a != s and a != 1 for a, s in zip(vt.shape, e.type.shape)):
        return None
    return e.inputs[0]


def _dtype(b: GraphBuilder, j: int) -> object:
    ts = b.nodes[j].types
    return ts[0].dtype if len(ts) == 1 and ts[0] is not None else None


def sink_expand(g: Graph) -> Graph:
    """One forward sweep (chains of ops move one expand down op by op), then ``dce``."""
    if GraphFacts(g).has_mutation:
        return g
    outs = set(g.outputs)
    b = GraphBuilder()
    b.constants = list(g.constants)
    new: dict[int, int] = {}
    changed = False
    for i, n in enumerate(g.nodes):
        m = n.with_(inputs=tuple(new[j] for j in n.inputs))
        if _is_math(n) and i not in outs:
            m, moved = _rewrite(b, m)
            changed = changed or moved
        new[i] = b.add(m) if not isinstance(m, int) else m
    if not changed:
        return g
    return dce(b.build(new[o] for o in g.outputs))


def _rewrite(b: GraphBuilder, n: Node) -> tuple[Node | int, bool]:
    shape = tuple(n.type.shape)
    tensors = [k for k, j in enumerate(n.inputs) if _dtype(b, j) is not None]
    srcs = {k: _source(b, n.inputs[k]) for k in tensors}
    srcs = {k: v for k, v in srcs.items() if v is not None}
    if not srcs:
        return n, False
    full = [
        k for k in tensors if k not in srcs and tuple(b.nodes[n.inputs[k]].types[0].shape) == shape
    ]
    if full:  # another operand is S-shaped: read every expand's source
        ins = tuple(srcs.get(k, j) for k, j in enumerate(n.inputs))
        return n.with_(inputs=ins), True
    if len(tensors) == 1:  # the only tensor operand: compute on the source, expand the result
        k = tensors[0]
        v = srcs[k]
        vt = b.nodes[v].types[0]
        small = n.with_(
            inputs=tuple(v if q == k else j for q, j in enumerate(n.inputs)),
            types=(TensorType(tuple(vt.shape), n.type.dtype),),
        )
        s = b.add(small)
        e = b.nodes[n.inputs[k]]
        return Node(EXPAND, (s,), (In(0), e.args[1]), (), n.types), True
    return n, False
