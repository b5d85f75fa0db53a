"""ReLU + max pool: one node, so that the ReLU's output is pooled as it is written.

A CNN's ``max_pool2d(relu(conv(x)))`` is a pointwise kernel that writes the ReLU's output (kept:
the ReLU's backward reads it) and a pool that reads it back::

    %r = relu.default(%c)                                   : f32[N,C,H,W]
    %p = max_pool2d_with_indices.default(%r, [2, 2])        : f32[N,C,H/2,W/2], i64[...]
    %v = getitem(%p, 0)      %i = getitem(%p, 1)
  becomes
    %f = relu_max_pool2d.default(%c, [2, 2])                : f32[N,C,H,W], f32[...], i64[...]
    %r = getitem(%f, 0)      %v = getitem(%f, 1)      %i = getitem(%f, 2)

``relu_max_pool2d`` (record and reference in :mod:`kiln.ir.ops`) returns the ReLU's output and
the pool's two outputs; the C++ backend runs it as one kernel (:mod:`kiln.codegen.cpp.pool`)
that pools each plane right after writing its ReLU (the plane still in cache) instead of a second
pass over the ReLU's output.

Needs: a typed graph in topological order (one of the C++ backend's own passes, before ``fuse``,
which would otherwise take the ``relu``).  Guarantees: same output values, shapes and dtypes;
only a float32 ``relu`` read by a ``max_pool2d_with_indices`` with positional arguments (its
first such reader) is rewritten, in graphs that mutate nothing; the ReLU's other readers read
the new node's first output; everything else is left as it is.  ``KILN_DISABLE_PASSES=relu_pool``
turns it off.
"""

from __future__ import annotations

import torch

from kiln.ir.graph import Graph, GraphBuilder, In, Node
from kiln.passes._util import GraphFacts

OP = "relu_max_pool2d.default"
_POOL = "max_pool2d_with_indices.default"
_RELU = "relu.default"


def _pairs(g: Graph) -> dict[int, int]:
    """ReLU node -> the first pool node that reads it (both of the form the pass takes, the
    pool read only through getitems)."""
    pairs: dict[int, int] = {}
    outputs = set(g.outputs)
    for i, n in enumerate(g.nodes):
        if n.op != _POOL or n.kwargs or len(n.inputs) != 1 or not n.args or n.args[0] != In(0):
            continue
        if len(n.types) != 2 or i in outputs:
            continue
        if any(g.nodes[u].op != "getitem" for u in g.users[i]):
            continue
        r = n.inputs[0]
        rn = g.nodes[r]
        if rn.op != _RELU or rn.kwargs or rn.args != (In(0),) or r in pairs:
            continue
        if rn.type is None or rn.type.dtype != torch.float32:
            continue
        pairs[r] = i
    return pairs


def relu_pool(g: Graph) -> Graph:
    """Rewrite every ReLU -> max pool pair (see the module docstring)."""
    if not any(n.op == _POOL for n in g.nodes):
        return g
    pairs = _pairs(g)
    if not pairs or GraphFacts(g).has_mutation:
        return g
    pools = {p: r for r, p in pairs.items()}
    b = GraphBuilder()
    remap: list[int] = [-1] * len(g.nodes)
    fused: dict[int, int] = {}  # pool node (old id) -> the fused node (new id)
    for i, n in enumerate(g.nodes):
        if n.op == "constant":
            remap[i] = b.constant(g.constants[n.kwarg("index")])
            continue
        if i in pairs:  # the ReLU: the fused node here (its pool reads nothing else)
            pool = g.nodes[pairs[i]]
            f = b.add(Node(OP, (remap[n.inputs[0]],), pool.args, (), (n.types[0], *pool.types)))
            fused[pairs[i]] = f
            remap[i] = b.getitem(f, 0)
            continue
        if i in pools:  # the pool: its getitems read the fused node
            continue
        if n.op == "getitem" and n.inputs[0] in fused:
            remap[i] = b.getitem(fused[n.inputs[0]], int(n.args[1]) + 1)
            continue
        remap[i] = b.add(n.with_(inputs=tuple(remap[j] for j in n.inputs)))
    return b.build(remap[o] for o in g.outputs)
