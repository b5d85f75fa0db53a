"""Max-pool backward + ReLU backward: one node, so that the gradient is written once.

A CNN's ``max_pool2d(relu(conv(x)))`` differentiates to a max-pool backward (ATen zero-fills the
input-sized gradient, then adds each output gradient at its argmax) and the ReLU's backward, a
pointwise ``where(le(r, 0), 0, .)`` over the same input-sized tensor (``r`` the ReLU's output)::

    %m = max_pool2d_with_indices_backward.default(%g, %r, k, s, p, d, ceil, %idx)  : f32[N,C,H,W]
    %c = le.Scalar(%r, 0)                                                        : b8[N,C,H,W]
    %d = where.self(%c, %zero, %m)        (or threshold_backward.default(%m, %r, 0))
  becomes
    %d = max_pool2d_relu_backward.default(%g, %r, k, s, p, d, ceil, %idx)

``max_pool2d_relu_backward`` (record and reference in :mod:`kiln.ir.ops`) is exactly that
composition; the C++ backend runs it as one kernel (:mod:`kiln.codegen.cpp.pool`) that writes the
gradient once and reads ``r`` only where an index points, instead of a zero fill, a scatter and a
pointwise pass that reads two input-sized tensors and writes a third.

Needs: a typed graph in topological order (this pass is one of the C++ backend's own passes,
before ``fuse``).  Guarantees: same output values, shapes and dtypes; only float32 gradients, a
``le`` against the number 0 of the pool backward's own ``self`` input, a ``where`` whose other
value is a constant +0.0 (or a ``threshold_backward`` with threshold 0), and a pool backward read
by nothing else (and not a graph output) are rewritten, in graphs that mutate nothing; the pool
backward is dropped; everything else is left as it is.  ``KILN_DISABLE_PASSES=pool_relu`` turns
it off.
"""

from __future__ import annotations

import math

import torch

from kiln.ir.graph import Graph, In, Node
from kiln.passes._util import Rewriter
from kiln.passes.dce import dce
from kiln.passes.rewrite import Rule, apply_rules

OP = "max_pool2d_relu_backward.default"
_POOL_BWD = "max_pool2d_with_indices_backward.default"
F32 = torch.float32


def _is_zero(v: object) -> bool:
    """The number +0 (a Python int or float; -0.0 is not: ``where`` would keep its sign)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return v == 0 and math.copysign(1.0, v) > 0


def _pool_backward(rw: Rewriter, m: int, r: int) -> Node | None:
    """The pool backward node ``m`` if its ``self`` is ``r``, it is float32 and only the node
    being rewritten reads it."""
    n = rw.node(m)
    if n.op != _POOL_BWD or len(n.inputs) != 3 or n.inputs[1] != r:
        return None
    if n.type is None or n.type.dtype != F32 or rw.old_users(m) != 1:
        return None
    old = rw.old_id(m)
    if old is None or old in rw.facts.outputs:
        return None
    return n


def _fused(rw: Rewriter, n: Node, pool: Node) -> Node | None:
    if n.type != pool.type:
        return None
    return Node(OP, pool.inputs, pool.args, pool.kwargs, n.types)


def where_of_pool_backward(rw: Rewriter, n: Node) -> Node | None:
    """``where(le(r, 0), +0.0, max_pool2d_with_indices_backward(g, r, ...))`` -> one node."""
    if rw.facts.has_mutation or n.kwargs or n.args != (In(0), In(1), In(2)):
        return None
    cond, zero, m = n.inputs
    c = rw.node(cond)
    if c.op != "le.Scalar" or c.kwargs or len(c.args) != 2 or c.args[0] != In(0):
        return None
    if not _is_zero(c.args[1]):
        return None
    z = rw.constant(zero)
    if z is None or z.numel() != 1 or z.dim() != 0 or z.dtype != F32:
        return None
    if not _is_zero(float(z.item())):
        return None
    pool = _pool_backward(rw, m, c.inputs[0])
    return None if pool is None else _fused(rw, n, pool)


def threshold_backward_of_pool_backward(rw: Rewriter, n: Node) -> Node | None:
    """``threshold_backward(max_pool2d_with_indices_backward(g, r, ...), r, 0)`` -> one node."""
    if rw.facts.has_mutation or n.kwargs or len(n.args) != 3:
        return None
    if n.args[:2] != (In(0), In(1)) or not _is_zero(n.args[2]):
        return None
    m, r = n.inputs
    pool = _pool_backward(rw, m, r)
    return None if pool is None else _fused(rw, n, pool)


RULES: tuple[Rule, ...] = (
    Rule("where_of_pool_backward", ("where.self",), where_of_pool_backward),
    Rule(
        "threshold_backward_of_pool_backward",
        ("threshold_backward.default",),
        threshold_backward_of_pool_backward,
    ),
)


def pool_relu(g: Graph) -> Graph:
    """Apply :data:`RULES`; the pool backward nodes they replace are dropped."""
    if not any(n.op == _POOL_BWD for n in g.nodes):
        return g
    out = apply_rules(g, RULES, max_iters=1)
    return out if out is g else dce(out)
