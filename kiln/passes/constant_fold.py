"""Constant folding: evaluate nodes whose inputs are all small ``constant`` nodes, at compile time.

Needs: a well-formed graph.  Guarantees: a folded node becomes a ``constant`` holding exactly what
ATen computes for it (so results are bit-identical), of the node's type.  Folded only: single-output
tensor nodes with static shapes, every input a ``constant`` and every tensor involved smaller than
:data:`MAX_ELEMENTS`; never random, opaque, meta (``scalar`` inputs, sizes) or uninitialised
(``empty*``) nodes, and never a graph output (the caller could mutate the stored tensor).  Nodes
whose evaluation raises stay as they are.  Folded nodes' inputs become dead and are left to ``dce``.

Example::

    %0 = constant[0] : f32[4]
    %1 = mul.Tensor(%0, 2.0) : f32[4]
    %2 = add.Tensor(%x, %1) : f32[4]
  becomes
    %0 = constant[0] : f32[4]
    %1 = constant[1] : f32[4]        (the values of %0 * 2.0)
    %2 = add.Tensor(%x, %1) : f32[4]
"""

from __future__ import annotations

import torch

from kiln.ir.graph import Graph, Node
from kiln.ir.ops import SIDE_EFFECTS, Category
from kiln.ir.semantics import call_node
from kiln.passes._util import Rewriter, cat_of, packet, static_numel

MAX_ELEMENTS = 4096
_NEVER = (Category.RANDOM, Category.OPAQUE, Category.META, Category.COLLECTIVE)
_UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def _foldable(rw: Rewriter, n: Node) -> bool:
    c = cat_of(n.op)
    if c is None or c in _NEVER or n.op in SIDE_EFFECTS or packet(n.op) in _UNINITIALISED:
        return False
    if len(n.types) != 1 or rw.is_output:
        return False
    size = static_numel(n.types[0])
    if size is None or size >= MAX_ELEMENTS:
        return False
    for j in n.inputs:
        t = rw.constant(j)
        if t is None or t.numel() >= MAX_ELEMENTS:
            return False
    return True


def fold(rw: Rewriter, n: Node) -> int | None:
    if not _foldable(rw, n):
        return None
    try:
        with torch.no_grad():
            v = call_node(n, [rw.constant(j) for j in n.inputs])
    except Exception:  # noqa: BLE001 - an op that cannot run here is simply not folded
        return None
    t = n.types[0]
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
        return None
    new = rw.b.constant(v.detach().clone())
    rw.origin[new] = rw.current
    return new


def constant_fold(g: Graph) -> Graph:
    """Fold every foldable node, in one forward sweep (folds chain: a folded node is a constant
    for the nodes after it)."""
    if not any(n.op == "constant" for n in g.nodes) and not any(
        cat_of(n.op) is Category.FACTORY for n in g.nodes
    ):
        return g
    return Rewriter(g).run(fold)
