"""Rotations: RoPE's ``rotate_half`` and its gradient as one ``roll`` the fuser reads by index.

Llama-style rotary embeddings compute ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat([-x[..., h:], x[..., :h]], -1)``: in the forward graph two slices, a ``neg``
kernel and a ``cat`` copy; in the backward graph the gradient of that ``cat`` of slices is
``full(0)`` + two ``slice_scatter`` copies + an ``add``.  A rotation along one dim is a ``roll``,
which the C++ backend fuses as a read of its input at a rotated index (the kernel's loop over the
last dim runs in two segments), so both become part of the pointwise kernel around them.  Rules:

* ``add(slice_scatter(zeros, a, d, 0, s), slice_scatter(zeros, b, d, s, L))`` (either order,
  ``zeros`` a zero fill of the result's type -- ``full``/``zeros`` and their ``_like`` forms, or
  ``new_zeros``, which both lazy recorders write for the gradient of a slice -- the two ranges
  covering ``[0, L)``) -> ``cat([a, b], d)``; ``slice_backward(a, shape, d, 0, s, 1)`` recorded
  as one opaque ATen node is the same ``slice_scatter`` into zeros;
* ``cat([±slice(x, d, s, L), ±slice(x, d, 0, s)], d)`` (each segment possibly ``neg``) ->
  ``roll(x, L - s, d)``, times a constant of ``-1``/``1`` along ``d`` when a segment is negated;
* ``roll(mul(a, b), k, d)`` whose ``mul`` has no other reader -> ``mul(roll(a, k, d), roll(b, k,
  d))`` (an operand of size 1 along ``d`` is not rolled, a broadcast one is expanded to the
  product's shape first), so that the roll reads a kernel input instead of a value the same
  kernel computes (the gradient's ``dy * sin``).

The two slices (or negated slices) must read the same tensor: the same value, or two view nodes
equal op for op down to a common value (the lazy device replays a tensor's view chain at every
read, so ``x[..., h:]`` and ``x[..., :h]`` of one ``view``/``transpose`` of a projection read two
equal chains until ``cse`` merges them, which runs later).

Needs: a well-formed graph.  Guarantees: the same values, shapes and dtypes (a rotation moves
elements; ``neg`` and ``* -1`` give the same bits), except that ``-0.0 + 0.0`` in the scattered
``add`` was ``+0.0`` and its ``cat`` keeps ``-0.0``, as ``x + 0 -> x`` in :mod:`simplify`.  Only
static sizes along ``d`` are rewritten; dead slices, negs and fills are left to ``dce``, except
the ``slice_backward`` nodes a replaced pair leaves unread, which this pass drops (``dce`` keeps
every opaque node).

Example (x: f32[2,4]; rotate_half)::

    %1 = slice.Tensor(%0, 1, 2, 4)       %4 = roll.default(%0, [2], [1])
    %2 = neg.default(%1)            ->   %5 = constant[0] : f32[4]        (-1, -1, 1, 1)
    %3 = slice.Tensor(%0, 1, 0, 2)       %6 = mul.Tensor(%4, %5)
    %7 = cat.default([%2, %3], 1)
"""

from __future__ import annotations

import torch

from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.passes._util import INT64_MAX, Rewriter, slice_range, static_dim, unit_slice_of
from kiln.passes.dce import dce, keep_only
from kiln.passes.rewrite import Rule, apply_rules

_ZERO_FILLS = (
    "full.default",
    "zeros.default",
    "full_like.default",
    "zeros_like.default",
    "new_zeros.default",  # the lazy recorders' slice_backward: new_zeros + slice_scatter
)
_SLICE_BACKWARD = "opaque.aten::slice_backward.default"
# views: a node of one of these ops is a function of its input and its arguments alone
_VIEWS = frozenset(
    {
        "view.default",
        "_unsafe_view.default",
        "reshape.default",
        "transpose.int",
        "t.default",
        "permute.default",
        "expand.default",
        "unsqueeze.default",
        "squeeze.dim",
        "squeeze.dims",
        "slice.Tensor",
        "select.int",
    }
)
_SAME_DEPTH = 8  # view nodes compared down a chain at most


def _same_value(rw: Rewriter, a: int, b: int, depth: int = _SAME_DEPTH) -> bool:
    """Whether values ``a`` and ``b`` are the same tensor: one value, or view nodes with equal
    ops, arguments and types over inputs that are the same tensor (module docstring)."""
    if a == b:
        return True
    if depth == 0:
        return False
    na, nb = rw.node(a), rw.node(b)
    if na.op != nb.op or na.op not in _VIEWS or len(na.inputs) != 1 or len(nb.inputs) != 1:
        return False
    if na.args != nb.args or na.kwargs != nb.kwargs or na.types != nb.types:
        return False
    return _same_value(rw, na.inputs[0], nb.inputs[0], depth - 1)


def _is_zero_fill(rw: Rewriter, v: int, t: TensorType) -> bool:
    n = rw.node(v)
    if n.op not in _ZERO_FILLS or rw.type(v) != t:
        return False
    if n.op in ("zeros.default", "zeros_like.default", "new_zeros.default"):
        return True
    value = n.args[1] if len(n.args) > 1 else None
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def scatter_pair_to_cat(rw: Rewriter, n: Node) -> Node | None:
    """``add`` of two slice_scatters into zeros that tile the dim -> ``cat`` (module docstring)."""
    if n.kwargs or len(n.args) != 2 or not all(isinstance(a, In) for a in n.args):
        return None
    t = n.type
    parts = []
    for a in n.args:
        s = rw.node(n.inputs[a.k])
        if s.op == _SLICE_BACKWARD:
            args = _slice_backward_args(s, t)
            if args is None:
                return None
        else:
            if s.op != "slice_scatter.default" or s.kwargs or len(s.args) < 2:
                return None
            if s.args[0] != In(0) or not isinstance(s.args[1], In):
                return None
            if t is None or not _is_zero_fill(rw, s.inputs[0], t):
                return None
            # slice_scatter(zeros, src, dim, start, end, step)
            args = list(s.args) + [0, None, None, 1][len(s.args) - 2 :]
        dim = static_dim(t, args[2])
        if dim is None or args[5] != 1:
            return None
        r = slice_range(args[3] or 0, INT64_MAX if args[4] is None else args[4], dim[1])
        src = s.inputs[args[1].k]
        st = rw.type(src)
        if r is None or st is None or st.dtype != t.dtype:
            return None
        parts.append((dim, r, src))
    (d0, r0, a0), (d1, r1, a1) = sorted(parts, key=lambda p: p[1])
    if d0 != d1 or r0[0] != 0 or r0[1] != r1[0] or r1[1] != d0[1] or r0[1] in (0, d0[1]):
        return None
    return Node("cat.default", (a0, a1), ([In(0), In(1)], d0[0]), (), (t,))


def _slice_backward_args(s: Node, t: TensorType | None) -> list | None:
    """``slice_backward(grad, shape, dim, start, end, step)`` of type ``t`` as the arguments
    ``[zeros, src, dim, start, end, step]`` of the ``slice_scatter`` into zeros it computes."""
    if t is None or s.kwargs or len(s.args) != 6 or s.args[0] != In(0) or s.types != (t,):
        return None
    shape = s.args[1]
    if not isinstance(shape, (list, tuple)) or tuple(shape) != tuple(t.shape):
        return None
    return [None, s.args[0], *s.args[2:]]


def _segment(rw: Rewriter, v: int, d: int) -> tuple[int, int, int, bool] | None:
    """``(x, start, end, negated)`` when ``v`` is ``slice(x, d, ...)`` or ``neg`` of one."""
    n = rw.node(v)
    neg = n.op == "neg.default"
    if neg:
        if n.kwargs or n.args != (In(0),):
            return None
        v = n.inputs[0]
    s = unit_slice_of(rw, v, d)
    return None if s is None else (*s, neg)


def rotation_of_slices(rw: Rewriter, n: Node) -> Node | None:
    """``cat`` of the two halves of a tensor in swapped order -> ``roll`` (module docstring)."""
    if n.kwargs or not n.args or len(n.args) > 2:
        return None
    items = n.args[0]
    if not isinstance(items, (list, tuple)) or len(items) != 2:
        return None
    if not all(isinstance(a, In) for a in items):
        return None
    t = n.type
    dim = static_dim(t, n.args[1] if len(n.args) > 1 else 0)
    if dim is None:
        return None
    d, size = dim
    segs = [_segment(rw, n.inputs[a.k], d) for a in items]
    if segs[0] is None or segs[1] is None:
        return None
    (x0, s0, e0, neg0), (x1, s1, e1, neg1) = segs
    if (
        not _same_value(rw, x0, x1)
        or rw.type(x0) != t
        or e0 != size
        or s1 != 0
        or e1 != s0
        or not 0 < s0 < size
    ):
        return None
    if (neg0 or neg1) and not t.dtype.is_floating_point:
        return None
    roll_t = TensorType(t.shape, t.dtype)
    roll = Node("roll.default", (x0,), (In(0), [size - s0], [d]), (), (roll_t,))
    if not (neg0 or neg1):
        return roll
    r = rw.add(roll)
    sign = torch.ones((size,) + (1,) * (len(t.shape) - 1 - d), dtype=t.dtype)
    sign[: size - s0] = -1.0 if neg0 else 1.0
    sign[size - s0 :] = -1.0 if neg1 else 1.0
    c = rw.b.constant(sign)
    return Node("mul.Tensor", (r, c), (In(0), In(1)), (), (t,))


def _roll_args(n: Node) -> tuple[int, int] | None:
    """(shift, dim) of a one-dim ``roll`` node."""
    if n.op != "roll.default" or n.kwargs or len(n.args) != 3 or n.args[0] != In(0):
        return None
    shifts, dims = n.args[1], n.args[2]
    if not isinstance(shifts, (list, tuple)) or not isinstance(dims, (list, tuple)):
        return None
    if len(shifts) != 1 or len(dims) != 1:
        return None
    if not isinstance(shifts[0], int) or not isinstance(dims[0], int):
        return None
    return shifts[0], dims[0]


def roll_of_product(rw: Rewriter, n: Node) -> Node | None:
    """``roll(a * b) -> roll(a) * roll(b)`` for a product read only by the roll."""
    ra = _roll_args(n)
    t = n.type
    if ra is None or t is None or rw.old_users(n.inputs[0]) != 1:
        return None
    dim = static_dim(t, ra[1])
    m = rw.node(n.inputs[0])
    if dim is None or m.op != "mul.Tensor" or m.kwargs or len(m.args) != 2:
        return None
    if m.types != (t,) or not all(isinstance(a, In) for a in m.args):
        return None
    d, rank = dim[0], len(t.shape)
    rolled = []
    for a in m.args:
        v = m.inputs[a.k]
        vt = rw.type(v)
        if vt is None or vt.dtype is None or len(vt.shape) > rank:
            return None
        vd = d - (rank - len(vt.shape))  # the operand's own dim under broadcasting
        if vd < 0 or vt.shape[vd] == 1:
            rolled.append(v)  # constant along d: a roll leaves it as it is
            continue
        if vt.shape[vd] != dim[1]:
            return None
        if vt.shape != t.shape:
            # a broadcast operand is rolled at the product's shape, through an expand (a view
            # the kernel reads by stride), so that the roll joins the product's kernel
            if not all(isinstance(k, int) for k in t.shape):
                return None
            et = TensorType(t.shape, vt.dtype)
            v = rw.add(Node("expand.default", (v,), (In(0), list(t.shape)), (), (et,)))
            vt = et
        roll = Node("roll.default", (v,), (In(0), [ra[0]], [d]), (), (vt,))
        rolled.append(rw.add(roll))
    return Node("mul.Tensor", tuple(rolled), (In(0), In(1)), (), (t,))


RULES: tuple[Rule, ...] = (
    # add(slice_scatter(0, a, d, 0, s), slice_scatter(0, b, d, s, L)) -> cat([a, b], d)
    Rule("scatter_pair_to_cat", ("add.Tensor",), scatter_pair_to_cat),
    # cat([±x[s:], ±x[:s]], d) -> roll(x, L - s, d) (* a -1/1 constant)
    Rule("rotation_of_slices", ("cat.default",), rotation_of_slices),
    # roll(a * b) -> roll(a) * roll(b): the roll reads kernel inputs
    Rule("roll_of_product", ("roll.default",), roll_of_product),
)


def rotate(g: Graph) -> Graph:
    """Apply the rotation :data:`RULES` (bounded, see :mod:`kiln.passes.rewrite`): the rolls
    first, then, with the slices they replaced dropped (so a product's readers are counted right),
    the product rule."""
    g2 = apply_rules(g, RULES[:2])
    if g2 is g:
        return g
    return apply_rules(dce(_drop_unread_slice_backward(g2)), RULES[2:])


def _drop_unread_slice_backward(g: Graph) -> Graph:
    """``g`` without the ``slice_backward`` nodes nothing reads any more (the scattered pairs
    replaced by a ``cat``): ``dce`` keeps every opaque node, this one is a pure function of its
    input."""
    outputs = set(g.outputs)
    dead = {
        i
        for i, n in enumerate(g.nodes)
        if n.op == _SLICE_BACKWARD and not g.users[i] and i not in outputs
    }
    if not dead:
        return g
    return keep_only(g, [i not in dead for i in range(len(g.nodes))])
