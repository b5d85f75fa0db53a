"""Common-subexpression elimination: a node computing exactly what an earlier node computes is
replaced by that earlier node.

Needs: a well-formed graph.  Guarantees: same outputs.  Two nodes are the same when op, inputs (after
merging), argument templates and types are equal (literals compared by ``repr``, so ``0.0`` and
``-0.0``, ``1`` and ``True`` stay apart); ``constant`` nodes are the same when their tensors are
(dtype, shape, bytes).  Never merged: random ops (two draws are two draws), opaque and other
side-effecting ops, unknown ops, graph inputs; and a graph output is only merged when it is a view
or a size (otherwise the caller would get one tensor twice where eager gives two).  Merged-away
nodes disappear; constants are re-collected.

Example::

    %1 = exp.default(%0) : f32[4]
    %2 = exp.default(%0) : f32[4]
    %3 = add.Tensor(%1, %2) : f32[4]
  becomes
    %1 = exp.default(%0) : f32[4]
    %2 = add.Tensor(%1, %1) : f32[4]
"""

from __future__ import annotations

from collections.abc import Hashable

from kiln.ir.graph import Graph, GraphBuilder, Node, tensor_digest
from kiln.ir.ops import SIDE_EFFECTS, Category
from kiln.passes._util import cat_of

_NEVER = (Category.RANDOM, Category.OPAQUE, Category.COLLECTIVE)
_OUTPUT_MERGEABLE = (Category.VIEW, Category.META)


def _key(n: Node, inputs: tuple[int, ...]) -> Hashable:
    return (n.op, inputs, repr(n.args), repr(n.kwargs), tuple(str(t) for t in n.types))


def cse(g: Graph) -> Graph:
    """Merge duplicate computations in one forward sweep."""
    b = GraphBuilder()
    remap: list[int] = []
    seen: dict[Hashable, int] = {}
    outputs = frozenset(g.outputs)
    for i, n in enumerate(g.nodes):
        if n.op in ("input", "scalar"):
            remap.append(b.add(n))
            continue
        if n.op == "constant":
            value = g.constants[n.kwarg("index")]
            key: Hashable = ("constant", str(n.types[0]), tensor_digest(value))
            if key in seen and i not in outputs:
                remap.append(seen[key])
                continue
            remap.append(b.constant(value))
            seen.setdefault(key, remap[-1])
            continue
        inputs = tuple(remap[j] for j in n.inputs)
        c = cat_of(n.op)
        mergeable = c is not None and c not in _NEVER and n.op not in SIDE_EFFECTS
        if mergeable and i in outputs and c not in _OUTPUT_MERGEABLE:
            mergeable = False
        key = _key(n, inputs) if mergeable else None
        if key is not None and key in seen:
            remap.append(seen[key])
            continue
        new = b.add(n.with_(inputs=inputs))
        remap.append(new)
        if key is not None:
            seen[key] = new
    return b.build(remap[o] for o in g.outputs)
