"""View/layout simplification around matmuls and reshapes.

ATen's GEMMs read strided operands directly: ``mm(a, t(b))`` and ``bmm(a, permute(b))`` need no
copy, so a transpose/permute feeding a matmul already *is* folded and stays as it is.  What this pass
removes are the copies that only exist to make an operand contiguous:

* ``contiguous`` / ``clone(memory_format=contiguous)`` / ``_to_copy`` to the same dtype, feeding a
  matmul operand: the matmul reads the source instead (the copy dies if nothing else reads it);
* ``view``/``_unsafe_view`` of such a copy (the decomposition of ``reshape`` on a non-contiguous
  tensor) whose copy has no other reader: ``reshape`` of the source, which copies only when the
  strides really need it;
* ``_unsafe_view`` -> ``view``: the same op for values (it only hides aliasing from autograd), so
  later passes see one spelling.

Needs: a well-formed graph.  Guarantees: same output values, shapes and dtypes; no output or value
that something mutates or reads the strides of becomes an alias; dead copies are left to ``dce``.

Example::

    %1 = clone.default(%0, memory_format=torch.contiguous_format) : f32[8,4]
    %2 = mm.default(%1, %w)                                       : f32[8,16]
  becomes  ``%2 = mm.default(%0, %w)``.
"""

from __future__ import annotations

import torch

from kiln.ir.graph import Graph, Node
from kiln.passes._util import Rewriter
from kiln.passes.rewrite import Rule, apply_rules
from kiln.passes.simplify import src

MATMULS = (
    "mm.default",
    "bmm.default",
    "addmm.default",
    "baddbmm.default",
    "matmul.default",
    "mv.default",
    "dot.default",
    "addmv.default",
    "linear.default",
)
_CONTIGUOUS_FORMATS = (None, torch.contiguous_format, torch.preserve_format)


def copy_source(rw: Rewriter, v: int) -> int | None:
    """If value ``v`` is a same-dtype (contiguous) copy of another value, that value."""
    n = rw.node(v)
    if (
        n.op == "clone.default"
        and n.kwarg("memory_format") in _CONTIGUOUS_FORMATS
        or n.op in ("contiguous.default", "contiguous.memory_format")
    ):
        x = src(n)
    elif n.op == "_to_copy.default":
        x = src(n)
        t = rw.type(x)
        if t is None or n.kwarg("dtype") not in (None, t.dtype) or n.kwarg("device") is not None:
            return None
        if n.kwarg("layout") not in (None, torch.strided):
            return None
        if n.kwarg("memory_format") not in _CONTIGUOUS_FORMATS:
            return None
    else:
        return None
    if len(n.args) != 1 or rw.type(x) != rw.type(v):
        return None
    return x


def matmul_reads_source(rw: Rewriter, n: Node) -> Node | None:
    if rw.facts.has_mutation:
        return None
    new_inputs = list(n.inputs)
    for k, v in enumerate(n.inputs):
        x = copy_source(rw, v)
        if x is not None:
            new_inputs[k] = x
    if new_inputs == list(n.inputs):
        return None
    return n.with_(inputs=tuple(new_inputs))


def reshape_of_copy(rw: Rewriter, n: Node) -> Node | None:
    v = src(n)
    x = copy_source(rw, v)
    if x is None or rw.old_users(v) != 1 or not rw.facts.aliases_safely(rw.current):
        return None
    return n.with_(op="reshape.default", inputs=(x,) + n.inputs[1:])


def unsafe_view_to_view(rw: Rewriter, n: Node) -> Node:
    return n.with_(op="view.default")


RULES: tuple[Rule, ...] = (
    # matmul(copy(x), ...) -> matmul(x, ...): GEMMs take strided operands
    Rule("matmul_reads_source", MATMULS, matmul_reads_source),
    # view(contiguous copy of x) -> reshape(x): copies only if the strides need it
    Rule("reshape_of_copy", ("view.default", "_unsafe_view.default"), reshape_of_copy),
    # _unsafe_view(x, s) -> view(x, s): same values, one spelling
    Rule("unsafe_view", ("_unsafe_view.default",), unsafe_view_to_view),
)


def layout(g: Graph) -> Graph:
    """Apply the layout :data:`RULES` (bounded, see :mod:`kiln.passes.rewrite`)."""
    return apply_rules(g, RULES)
