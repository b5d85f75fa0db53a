"""Constant folding: evaluate nodes whose inputs are all small ``constant`` nodes, at compile time.

Needs: a well-formed graph.  Guarantees: a folded node becomes a ``constant`` holding exactly what
ATen computes for it (so results are bit-identical), of the node's type.  Folded only: single-output
tensor nodes with static shapes, every input a ``constant`` and every tensor involved under
:data:`MAX_BYTES`; never random, opaque, meta (``scalar`` inputs, sizes) or uninitialised
(``empty*``) nodes.  Nodes whose evaluation raises stay as they are.  Folded nodes' inputs become
dead and are left to ``dce``.

A graph output is never the stored constant itself (the caller could mutate it for every later
run).  One with users inside the graph folds all the same: they read the constant, and the output
becomes ``clone(constant)``, a fresh copy per run.  (The forward graph of a training step returns
what backward reads: Llama's causal mask is built from a ``cumsum`` and ``index`` results that
backward reads too, so without this the whole mask chain, ~10 ATen calls a step, stayed.)  An
output with no users stays as it is: folding would only trade its op for a copy.

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

from kiln.ir.graph import Graph, In, Node
from kiln.ir.ops import SIDE_EFFECTS, Category
from kiln.ir.semantics import call_node
from kiln.passes._util import Rewriter, cat_of, packet, static_numel

# Largest tensor (result or input) a fold evaluates: what a graph keeps as a constant.  256 KiB
# takes a causal mask of 8 x 1 x 256 x 128 booleans; a (B, 1, S, S) mask past it is computed per
# run as before.
MAX_BYTES = 256 * 1024
_NEVER = (Category.RANDOM, Category.OPAQUE, Category.META, Category.COLLECTIVE)
_UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
_COPY_FORMATS = (None, torch.contiguous_format, torch.preserve_format)


class _Folder(Rewriter):
    def __init__(self, g: Graph) -> None:
        super().__init__(g)
        self.kept_outputs: dict[int, int] = {}  # an output's clone node -> the constant it copies


def _value(rw: _Folder, new_id: int) -> torch.Tensor | None:
    """The constant a node holds: a ``constant``, or an output's ``clone`` of one (below)."""
    t = rw.constant(new_id)
    if t is not None:
        return t
    n = rw.node(new_id)
    if n.op == "clone.default" and rw.kept_outputs.get(new_id) is not None:
        return rw.constant(n.inputs[0])
    return None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _foldable(rw: _Folder, n: Node) -> bool:
    c = cat_of(n.op)
    if c is None or c in _NEVER or n.op in SIDE_EFFECTS or packet(n.op) in _UNINITIALISED:
        return False
    if len(n.types) != 1 or n.types[0].dtype is None:
        return False
    if rw.is_output and (not rw.g.users[rw.current] or c is Category.VIEW):
        return False  # nothing in the graph gains; a view's clone would cost a copy
    size = static_numel(n.types[0])
    if size is None or size * n.types[0].dtype.itemsize > MAX_BYTES:
        return False
    for j in n.inputs:
        t = _value(rw, j)
        if t is None or _bytes(t) > MAX_BYTES:
            return False
    return True


def fold(rw: _Folder, n: Node) -> int | Node | None:
    if n.op == "clone.default" and rw.is_output and rw.constant(n.inputs[0]) is not None:
        return None  # an output's copy of its folded value (made below): kept as it is
    if not _foldable(rw, n):
        # inputs that are outputs' copies of constants: read the constants instead
        ins = tuple(rw.node(j).inputs[0] if j in rw.kept_outputs else j for j in n.inputs)
        return n.with_(inputs=ins) if ins != n.inputs else None
    try:
        with torch.no_grad():
            v = call_node(n, [_value(rw, j) for j in n.inputs])
    except Exception:  # noqa: BLE001 - an op that cannot run here is simply not folded
        return None
    t = n.types[0]
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
        return None
    new = rw.b.constant(v.detach().clone())
    rw.origin[new] = rw.current
    if not rw.is_output:
        return new
    copy = rw.add(Node("clone.default", (new,), (In(0),), (), n.types))
    rw.kept_outputs[copy] = new
    return copy


def constant_fold(g: Graph) -> Graph:
    """Fold every foldable node, in one forward sweep (folds chain: a folded node is a constant
    for the nodes after it)."""
    if not any(n.op == "constant" for n in g.nodes) and not any(
        cat_of(n.op) is Category.FACTORY for n in g.nodes
    ):
        return g
    return _Folder(g).run(fold)
