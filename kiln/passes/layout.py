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
  later passes see one spelling;
* ``cat`` of reshapes that all merge the same dims of same-shaped tensors (attention's q/k/v
  gradients: ``cat([view(permute(dq), (B, T, C)), ...], 2)``): ``view(cat(sources, e), ...)``
  along the first merged dim ``e``.  ATen's ``cat`` reads the (permuted) sources through their
  strides, so the copy each reshape made of a non-viewable source is gone; the view of the
  contiguous ``cat`` result is free;
* ``permute(view(bmm(a, b), (..., M, K)), P)`` where ``P`` does not keep ``K`` innermost (the
  key gradient of attention: ``q @ k^T``'s backward computes ``dk^T = q^T @ dS`` as (B*H, E, T),
  which the q/k/v gradient ``cat`` then reads with E strided by T, a gather: ATen's ``cat`` takes
  0.14 ms per call at gpt-large's shape, 0.057 ms with E contiguous): ``bmm(b^T, a^T)`` computes the
  transposed result, (B*H, T, E), and ``P'`` (``P`` with the last two dims swapped) reads the same
  elements with E contiguous.  ATen's GEMMs read the transposed operands by stride (no copy).
  Only where the bmm and its view have no other reader and the permuted value is read only by
  ``cat`` (dead readers aside), no graph output;
* ``sum`` over every dim but the last of a reshape that keeps the last dim (a linear layer's bias
  gradient: ``sum(view(dy, (B*T, C)), [0])``): the same sum over every leading dim of the
  reshape's source (then a view to the result's shape), so that the fusion pass can put it into
  the kernel that computes ``dy`` (one pass over ``dy`` instead of two).

Needs: a well-formed graph.  Guarantees: same output values, shapes and dtypes; no output or value
that something mutates or reads the strides of becomes an alias; dead nodes are removed before the
rules run (``dce``), copies the rules leave dead are left to a later ``dce``.

Example::

    %1 = clone.default(%0, memory_format=torch.contiguous_format) : f32[8,4]
    %2 = mm.default(%1, %w)                                       : f32[8,16]
  becomes  ``%2 = mm.default(%0, %w)``.
"""

from __future__ import annotations

import torch

from kiln.config import config
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.passes._util import Rewriter
from kiln.passes.dce import dce
from kiln.passes.rewrite import Rule, apply_rules
from kiln.passes.simplify import RESHAPES, src

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


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _merged_dims(x: tuple, s: tuple, d: int) -> tuple[int, int] | None:
    """The dims ``[e, f)`` of shape ``x`` that dim ``d`` of shape ``s`` is the row-major merge of
    (every dim before them merging into the dims of ``s`` before ``d``), or None."""
    before, upto = _prod(s[:d]), _prod(s[: d + 1])
    e = next((k for k in range(len(x) + 1) if _prod(x[:k]) == before), None)
    f = next((k for k in range(len(x) + 1) if _prod(x[:k]) == upto), None)
    if e is None or f is None or f <= e:
        return None
    return e, f


def cat_of_reshapes(rw: Rewriter, n: Node) -> Node | None:
    """``cat([reshape(x_i, S)], d) -> view(cat([x_i], e), S')`` (see the module docstring)."""
    if rw.facts.has_mutation or n.kwargs or not n.args or len(n.args) > 2:
        return None
    items = n.args[0]
    if not isinstance(items, (list, tuple)) or len(items) < 2:
        return None
    if not all(isinstance(a, In) for a in items):
        return None
    views = [rw.node(n.inputs[a.k]) for a in items]
    if not all(v.op in RESHAPES and v.args and v.args[0] == In(0) for v in views):
        return None
    xs = [v.inputs[0] for v in views]
    x_t, s_t, out_t = rw.type(xs[0]), rw.type(n.inputs[items[0].k]), n.type
    if x_t is None or s_t is None or out_t is None or x_t.dtype is None:
        return None
    shapes = [x_t.shape, s_t.shape, out_t.shape]
    if not all(isinstance(k, int) and k > 0 for sh in shapes for k in sh):
        return None  # symbolic or zero sizes: left as written
    if any(rw.type(x) != x_t or rw.type(n.inputs[a.k]) != s_t for x, a in zip(xs, items)):
        return None
    d = n.args[1] if len(n.args) > 1 else 0
    if not isinstance(d, int) or not -len(s_t.shape) <= d < len(s_t.shape):
        return None
    d %= len(s_t.shape)
    dims = _merged_dims(x_t.shape, s_t.shape, d)
    if dims is None:
        return None
    e = dims[0]
    cat_shape = list(x_t.shape)
    cat_shape[e] *= len(xs)
    cat = Node(
        "cat.default",
        tuple(xs),
        ([In(k) for k in range(len(xs))], e),
        (),
        (TensorType(tuple(cat_shape), x_t.dtype),),
    )
    c = rw.add(cat)
    return Node("view.default", (c,), (In(0), list(out_t.shape)), (), (out_t,))


def col_sum_of_reshape(rw: Rewriter, n: Node) -> Node | None:
    """``sum(reshape(x, S), leading dims of S) -> sum(x, leading dims of x)`` (see the docstring).

    Row-major, a reshape that keeps the last dim maps element ``(r, c)`` to an element of ``x``
    with last index ``c``: both sums add the same elements for each ``c``."""
    if rw.facts.has_mutation or n.kwargs or len(n.args) not in (2, 3) or n.args[0] != In(0):
        return None  # (under mutation, a reshape that copied may hold older values than x)
    if len(n.args) == 3 and not isinstance(n.args[2], bool):
        return None
    v = rw.node(n.inputs[0])
    if v.op not in RESHAPES or not v.args or v.args[0] != In(0):
        return None
    x = v.inputs[0]
    x_t, v_t, out_t = rw.type(x), rw.type(n.inputs[0]), n.type
    if x_t is None or v_t is None or out_t is None or x_t.dtype is None:
        return None
    if not all(isinstance(k, int) for k in out_t.shape):
        return None  # a shape-generic graph: the view below would take a size's symbolic text
    rank = len(v_t.shape)
    dims = n.args[1]
    if not isinstance(dims, (list, tuple)) or rank < 2 or len(x_t.shape) < 2:
        return None
    if sorted(d % rank for d in dims if isinstance(d, int)) != list(range(rank - 1)):
        return None
    if len(dims) != rank - 1 or x_t.shape[-1] != v_t.shape[-1]:
        return None
    lead = list(range(len(x_t.shape) - 1))
    flat_t = TensorType(tuple(x_t.shape[-1:]), out_t.dtype)
    s = Node("sum.dim_IntList", (x,), (In(0), lead, False), (), (flat_t,))
    if flat_t == out_t:
        return s
    return Node("view.default", (rw.add(s),), (In(0), list(out_t.shape)), (), (out_t,))


def _batch_split(shape: tuple, n_batch: int) -> bool:
    """``shape`` is a bmm result ``(N, M, K)`` with only its batch dim split: ``(..., M, K)``."""
    return (
        len(shape) >= 3 and all(isinstance(k, int) for k in shape) and _prod(shape[:-2]) == n_batch
    )


def permuted_bmm_transposed(rw: Rewriter, n: Node) -> Node | None:
    """``permute(view(bmm(a, b), (..., M, K)), P)`` whose innermost dim is not ``K`` ->
    ``permute(view(bmm(b^T, a^T), (..., K, M)), P')`` (see the module docstring)."""
    if rw.facts.has_mutation or n.kwargs or len(n.args) != 2 or n.args[0] != In(0):
        return None
    perm = n.args[1]
    v_id = n.inputs[0]
    v = rw.node(v_id)
    if v.op != "view.default" or v.kwargs or len(v.args) != 2 or v.args[0] != In(0):
        return None
    mm_id = v.inputs[0]
    mm = rw.node(mm_id)
    if mm.op != "bmm.default" or mm.kwargs or mm.args != (In(0), In(1)):
        return None
    if rw.old_users(v_id) != 1 or rw.old_users(mm_id) != 1:
        return None  # another reader of the GEMM's result would keep the old layout too
    mm_t, v_t, out_t = rw.type(mm_id), rw.type(v_id), n.type
    if (
        mm_t is None
        or v_t is None
        or out_t is None
        or not all(isinstance(k, int) for k in mm_t.shape)
    ):
        return None
    rank = len(v_t.shape)
    if not isinstance(perm, (list, tuple)) or sorted(p % rank for p in perm) != list(range(rank)):
        return None
    perm = [p % rank for p in perm]
    nb, m, k = mm_t.shape
    if not _batch_split(v_t.shape, nb) or tuple(v_t.shape[-2:]) != (m, k) or min(nb, m, k) <= 0:
        return None
    if perm[-1] == rank - 1 or not _value_readers_only(rw):
        return None  # already contiguous along K innermost, or a reader depends on the strides
    a, b = mm.inputs
    a_t, b_t = rw.type(a), rw.type(b)
    if a_t is None or b_t is None:
        return None
    dt = mm_t.dtype
    ta = rw.add(Node("permute.default", (a,), (In(0), [0, 2, 1]), (), (_swapped(a_t),)))
    tb = rw.add(Node("permute.default", (b,), (In(0), [0, 2, 1]), (), (_swapped(b_t),)))
    new_mm = rw.add(
        Node("bmm.default", (tb, ta), (In(0), In(1)), (), (TensorType((nb, k, m), dt),))
    )
    shape = list(v_t.shape[:-2]) + [k, m]
    new_v = rw.add(
        Node("view.default", (new_mm,), (In(0), shape), (), (TensorType(tuple(shape), dt),))
    )
    swap = {rank - 2: rank - 1, rank - 1: rank - 2}
    return Node("permute.default", (new_v,), (In(0), [swap.get(p, p) for p in perm]), (), (out_t,))


# readers whose result does not depend on their input's strides (a new contiguous tensor)
_VALUE_READERS = frozenset({"cat.default"})


def _value_readers_only(rw: Rewriter) -> bool:
    """The node being rewritten is no graph output and every reader is a ``cat`` or
    dead (``cat_of_reshapes`` leaves the reshapes it replaced dead until a ``dce``)."""
    g, i = rw.g, rw.current
    if i in rw.facts.outputs:
        return False
    return all(
        g.nodes[u].op in _VALUE_READERS or (not g.users[u] and u not in rw.facts.outputs)
        for u in g.users[i]
    )


def _swapped(t: TensorType) -> TensorType:
    return TensorType((t.shape[0], t.shape[2], t.shape[1]), t.dtype)


def unsafe_view_to_view(rw: Rewriter, n: Node) -> Node:
    return n.with_(op="view.default")


RULES: tuple[Rule, ...] = (
    # matmul(copy(x), ...) -> matmul(x, ...): GEMMs take strided operands
    Rule("matmul_reads_source", MATMULS, matmul_reads_source),
    # view(contiguous copy of x) -> reshape(x): copies only if the strides need it
    Rule("reshape_of_copy", ("view.default", "_unsafe_view.default"), reshape_of_copy),
    # _unsafe_view(x, s) -> view(x, s): same values, one spelling
    Rule("unsafe_view", ("_unsafe_view.default",), unsafe_view_to_view),
    # cat of reshapes merging the same dims -> view of the cat of their sources
    Rule("cat_of_reshapes", ("cat.default",), cat_of_reshapes),
    # sum over the leading dims of a reshape keeping the last dim -> the same sum of its source
    Rule("col_sum_of_reshape", ("sum.dim_IntList",), col_sum_of_reshape),
    # a bmm result read permuted with its last dim not innermost -> the transposed bmm
    Rule("permuted_bmm_transposed", ("permute.default",), permuted_bmm_transposed),
)


def layout(g: Graph) -> Graph:
    """Apply the layout :data:`RULES` (bounded, see :mod:`kiln.passes.rewrite`); a rule named
    ``layout.NAME`` in ``config.disable_passes`` is skipped (for same-process A/B of one rule).

    Dead nodes are dropped first: the rules count a copy's readers, and a dead reader (AOTAutograd's
    backward of transformers' attention reshapes the contiguous copy of the attention gradient
    twice and uses one) would keep the copy."""
    off = config.disabled_passes
    if "layout.dce" not in off:  # (switchable for A/B like a rule)
        g = dce(g)
    return apply_rules(g, tuple(r for r in RULES if f"layout.{r.name}" not in off))
