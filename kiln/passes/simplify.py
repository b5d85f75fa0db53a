"""Algebraic simplification: a declarative table of local rewrite rules (tinygrad style).

Needs: a well-formed graph.  Guarantees: the same outputs (same values, shapes and dtypes) for every
input; a node is only ever replaced by a value of exactly the same type, graph inputs and outputs
keep their order and ``index``; nodes that become unused are left for ``dce``.  Ops no rule names
pass through untouched; symbolic sizes are compared as opaque strings, never evaluated.

Deliberately *not* here: ``x * 0 -> 0`` (wrong for NaN and inf), ``pow(x, .5) -> sqrt`` (differs
at -inf), ``1/(1/x) -> x`` (rounds).  For floating-point values ``x + 0.0`` is not ``x`` either:
``-0.0 + 0.0`` is ``+0.0`` (IEEE round-to-nearest), so a float add drops only a ``-0.0`` addend and a
float sub only a ``+0.0`` subtrahend (``x + (-0.0)`` and ``x - 0.0`` are ``x`` for every ``x``);
integer adds drop any zero.  Before 2026-12-03 every ``x + 0`` was dropped and compiled
``x + 0.0`` returned ``-0.0`` where eager returns ``0.0``.

Example::

    %1 = mul.Tensor(%0, 1)                  : f32[4]
    %2 = neg.default(%1)                    : f32[4]
    %3 = neg.default(%2)                    : f32[4]
    %4 = permute.default(%3, [0])           : f32[4]
    return (%4)
  becomes  ``return (%0)`` (the mul and the first neg are now dead, ``dce`` drops them).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from kiln.config import config
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.ops import Category
from kiln.passes._util import Rewriter, cat_of, static_dim, unit_slice_of
from kiln.passes.rewrite import Rule, apply_rules

PERM_OPS = ("permute.default", "transpose.int", "t.default")
RESHAPES = ("view.default", "_unsafe_view.default", "reshape.default")
NOOP_VIEWS = RESHAPES + (
    "expand.default",
    "alias.default",
    "squeeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "slice.Tensor",
    "narrow.default",
)
_FOLDABLE_CONSTANT_NUMEL = 4096


# --- matching helpers -------------------------------------------------------------------------
def src(n: Node) -> int:
    """The tensor a view/unary node reads: its first argument, which must be ``In(0)``."""
    if not n.args or n.args[0] != In(0):
        raise ValueError(f"{n.op}: first argument is not a graph value")
    return n.inputs[0]


def number(rw: Rewriter, n: Node, pos: int) -> int | float | None:
    """The number at argument ``pos``: a Python literal, or a small constant holding one value.

    ``scalar`` graph inputs change every step and are never looked into.
    """
    if pos >= len(n.args):
        return None
    a = n.args[pos]
    if isinstance(a, In):
        t = rw.constant(n.inputs[a.k])
        if t is None or t.numel() == 0 or t.numel() > _FOLDABLE_CONSTANT_NUMEL or t.is_complex():
            return None
        flat = t.reshape(-1)
        if not bool((flat == flat[0]).all()):
            return None
        return flat[0].item()
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a
    return None


def value_at(n: Node, pos: int) -> int | None:
    a = n.args[pos]
    return n.inputs[a.k] if isinstance(a, In) else None


def drop_neutral(
    rw: Rewriter,
    n: Node,
    neutral: float,
    commutes: bool,
    alpha_scales_other: bool,
    zero_sign: float | None = None,
) -> int | None:
    """``x op neutral -> x`` (and ``neutral op x -> x`` if the op commutes).

    ``zero_sign`` (adds: 1, subs: -1) asks a zero to leave every float ``x`` unchanged: the
    addend, ``zero_sign * alpha * zero``, must be ``-0.0`` (see the module docstring).

    The table binds ``neutral``/``commutes``/``alpha_scales_other`` with ``functools.partial``
    rather than a closure built at import, so the rule's code runs (and can be instrumented, e.g.
    by a mutation tool) each time it is tried.
    """
    if len(n.args) < 2:
        return None
    alpha = n.kwarg("alpha", 1)
    if alpha != 1 and not alpha_scales_other:
        return None
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        return None  # x + inf * 0 is NaN
    scaled_sign = None if zero_sign is None else zero_sign * math.copysign(1, alpha)
    if (
        number(rw, n, 1) == neutral
        and value_at(n, 0) is not None
        and (scaled_sign is None or _zero_leaves_x(rw, n, 1, scaled_sign))
    ):
        return value_at(n, 0)
    if (
        commutes
        and alpha == 1
        and number(rw, n, 0) == neutral
        and value_at(n, 1) is not None
        and (zero_sign is None or _zero_leaves_x(rw, n, 0, zero_sign))
    ):
        return value_at(n, 1)
    return None


def _zero_leaves_x(rw: Rewriter, n: Node, pos: int, sign: float) -> bool:
    """Whether the zero at argument ``pos`` (times ``sign``: alpha's sign, and -1 for a
    subtrahend) is ``-0.0``, the addend that leaves every float ``x`` as it is; any zero does for
    integer and bool results.  A constant whose zeros differ in sign is not taken."""
    if not (n.types[0].dtype.is_floating_point or n.types[0].dtype.is_complex):
        return True
    a = n.args[pos]
    if isinstance(a, In):
        t = rw.constant(n.inputs[a.k])
        if t is None:
            return False
        if t.is_floating_point() or t.is_complex():
            signs = torch.signbit(t.reshape(-1).real)
            if bool(signs.any()) and not bool(signs.all()):
                return False
            negative = bool(signs[0])
        else:
            negative = False  # an integer zero is +0.0 in a float op
    else:
        negative = isinstance(a, float) and math.copysign(1.0, a) < 0
    return negative == (sign > 0)


def square(rw: Rewriter, n: Node) -> Node | None:
    x = src(n)
    if number(rw, n, 1) != 2 or isinstance(n.args[1], In) or rw.type(x) is None:
        return None
    if rw.type(x).dtype != n.types[0].dtype:
        return None
    return Node("mul.Tensor", (x, x), (In(0), In(1)), (), n.types)


def neg_neg(rw: Rewriter, n: Node) -> int | None:
    inner = rw.node(src(n))
    return src(inner) if inner.op == "neg.default" else None


def perm(rw: Rewriter, n: Node) -> tuple[int, ...]:
    """The dimension order a permute / transpose / t node produces."""
    x = src(n)
    if n.op == "permute.default":
        dims = tuple(n.args[1])
        r = len(dims)
        return tuple(d % r for d in dims)
    r = len(rw.type(x).shape)
    order = list(range(r))
    if n.op == "t.default":
        if r == 2:
            order = [1, 0]
        return tuple(order)
    d0, d1 = (n.args[1] % r, n.args[2] % r) if r else (0, 0)
    if r:
        order[d0], order[d1] = order[d1], order[d0]
    return tuple(order)


def perm_of_perm(rw: Rewriter, n: Node) -> int | Node | None:
    inner = rw.node(src(n))
    if inner.op not in PERM_OPS:
        return None
    p, q = perm(rw, inner), perm(rw, n)
    combined = tuple(p[q[i]] for i in range(len(q)))
    x = src(inner)
    if combined == tuple(range(len(combined))):
        return x
    return Node("permute.default", (x,), (In(0), combined), (), n.types)


def perm_identity(rw: Rewriter, n: Node) -> int | None:
    p = perm(rw, n)
    return src(n) if p == tuple(range(len(p))) else None


def view_chain(rw: Rewriter, n: Node) -> Node | None:
    inner = rw.node(src(n))
    if inner.op not in RESHAPES:
        return None
    op = "reshape.default" if "reshape.default" in (inner.op, n.op) else n.op
    return n.with_(op=op, inputs=(src(inner),) + n.inputs[1:])


def noop_view(rw: Rewriter, n: Node) -> int | None:
    x = src(n)
    if len(n.types) != 1 or rw.type(x) != n.types[0]:
        return None
    # Sizes that come from graph values (``view(x, [%s0, 16])``) are only provably the same as x's
    # when the types say so symbolically; types recorded as the trace-time hint do not prove it.
    sized_by_values = len(n.inputs) > 1
    if sized_by_values and all(isinstance(d, int) for d in n.types[0].shape):
        return None
    return x


# Ops whose result is a fresh, dense tensor (ATen lays outputs out dense and non-overlapping).
_FRESH = (Category.ELEMENTWISE, Category.REDUCTION, Category.MATMUL)


def _dense_source(rw: Rewriter, x: int) -> bool:
    """Is value ``x`` (new graph) the single output of an op that computes a fresh tensor?  A
    same-dtype copy of it (``clone``/``_to_copy``, preserve format) has its exact strides and
    offset, so even ``view`` may read ``x`` in the copy's place."""
    p = rw.node(x)
    return len(p.types) == 1 and cat_of(p.op) in _FRESH


def _copy_may_go(rw: Rewriter, n: Node) -> bool:
    if rw.type(src(n)) != n.type:
        return False
    same = _dense_source(rw, src(n))
    return rw.facts.aliases_safely(rw.current, same_strides=same)


def neutral_cast(rw: Rewriter, n: Node) -> int | None:
    x = src(n)
    t = rw.type(x)
    if t is None or n.kwarg("dtype") not in (None, t.dtype):
        return None
    if n.kwarg("layout") not in (None, torch.strided) or n.kwarg("device") is not None:
        return None
    if n.kwarg("memory_format") not in (None, torch.preserve_format):
        return None
    if n.kwarg("pin_memory") not in (None, False) or len(n.args) != 1:
        return None
    return x if _copy_may_go(rw, n) else None


def drop_clone(rw: Rewriter, n: Node) -> int | None:
    if n.kwarg("memory_format") not in (None, torch.preserve_format) or len(n.args) != 1:
        return None
    return src(n) if _copy_may_go(rw, n) else None


SMALL_SUM = 4  # a sum over one (not the last) dim of at most this many elements becomes adds


def small_sum(rw: Rewriter, n: Node) -> Node | None:
    """``sum(x, [d])`` over a dim of static size 2..:data:`SMALL_SUM` that is not the last dim
    -> ``select(x, d, 0) + select(x, d, 1) + ...`` (a view to the ``keepdim`` shape after).

    Grouped-query attention's backward sums the gradient of the repeated k/v heads over the group
    (``sum(view(dv, (B, KV, G, T, D)), [2])``): as ATen's reduction it is a separate op (with a
    zero fill) whose result is then permuted and copied for the projection's GEMM; as adds of
    strided views it is elementwise, so ``sink_permute`` computes it in the GEMM's order and the
    fuser makes it one kernel.  Same values: ATen sums a non-innermost dim element by element from
    zero, ``((0 + x0) + x1) + ...``, which is these adds (up to the sign of a zero)."""
    if n.kwargs or len(n.args) not in (2, 3) or n.args[0] != In(0):
        return None
    keep = n.args[2] if len(n.args) == 3 else False
    dims = n.args[1]
    x = src(n)
    xt, out = rw.type(x), n.types[0]
    if not isinstance(keep, bool) or xt is None or out is None:
        return None
    if xt.dtype not in (torch.float32, torch.float64) or out.dtype != xt.dtype:
        return None
    if not all(isinstance(k, int) for k in xt.shape) or len(xt.shape) < 2:
        return None
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return None
    rank = len(xt.shape)
    if not -rank <= dims[0] < rank:
        return None
    d = dims[0] % rank
    if d == rank - 1 or not 2 <= xt.shape[d] <= SMALL_SUM:
        return None
    part = TensorType(tuple(xt.shape[:d]) + tuple(xt.shape[d + 1 :]), xt.dtype)
    acc = rw.add(Node("select.int", (x,), (In(0), d, 0), (), (part,)))
    for i in range(1, xt.shape[d]):
        s = rw.add(Node("select.int", (x,), (In(0), d, i), (), (part,)))
        total = Node("add.Tensor", (acc, s), (In(0), In(1)), (), (part,))
        if i == xt.shape[d] - 1 and not keep:
            return total
        acc = rw.add(total)
    return Node("view.default", (acc,), (In(0), list(out.shape)), (), (out,))


def squeeze_of_reshape(rw: Rewriter, n: Node) -> Node | None:
    """``squeeze(view(x, s))`` -> ``view(x, s without the squeezed size-1 dims)`` (a reshape if
    the inner one was): dropping size-1 dims never changes whether a view is possible."""
    inner = rw.node(src(n))
    out = n.types[0]
    if inner.op not in RESHAPES or out is None or not all(isinstance(k, int) for k in out.shape):
        return None
    op = "reshape.default" if inner.op == "reshape.default" else "view.default"
    return Node(op, (src(inner),), (In(0), list(out.shape)), (), n.types)


def _static_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def select_of_slice(rw: Rewriter, n: Node) -> Node | None:
    """``squeeze(slice(x, d, i, i + 1), [d])`` -> ``select(x, d, i)``: the same view (offset and
    strides) in one op.  ``unbind`` decomposes to the pair, and the optimizer forms' per-parameter
    numbers (``one_each``) are an unbind: two view calls per parameter and number at run time."""
    dims = n.args[1] if len(n.args) > 1 else None
    if n.op == "squeeze.dim":
        dims = [dims]
    if n.kwargs or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    sliced = rw.type(src(n))
    sq = static_dim(sliced, dims[0])
    if sq is None or sq[1] != 1:
        return None
    d = sq[0]
    s = unit_slice_of(rw, src(n), d)
    if s is None or s[2] - s[1] != 1:
        return None
    x, i, _ = s
    xt, out = rw.type(x), n.type
    if xt is None or out is None or out.dtype != xt.dtype:
        return None
    if tuple(out.shape) != tuple(xt.shape[:d]) + tuple(xt.shape[d + 1 :]):
        return None
    return Node("select.int", (x,), (In(0), d, i), (), n.types)


def stack_of_unsqueezes(rw: Rewriter, n: Node) -> Node | None:
    """``cat([unsqueeze(x_0, d), unsqueeze(x_1, d), ...], d)`` -> ``stack([x_0, x_1, ...], d)``:
    one ATen call instead of one per element plus the cat (``torch.stack`` is decomposed to the
    former; the optimizer forms stack their parameters' step counters)."""
    if n.kwargs or not 1 <= len(n.args) <= 2:
        return None
    items = n.args[0]
    if not isinstance(items, (list, tuple)) or not items:
        return None
    if not all(isinstance(a, In) for a in items):
        return None
    views = [rw.node(n.inputs[a.k]) for a in items]
    if not all(v.op == "unsqueeze.default" and len(v.args) == 2 and not v.kwargs for v in views):
        return None
    xs = [src(v) for v in views]
    x_t = rw.type(xs[0])
    if x_t is None or any(rw.type(x) != x_t for x in xs):
        return None
    rank = len(x_t.shape) + 1
    d = n.args[1] if len(n.args) > 1 else 0
    if _static_int(d) is None or not -rank <= d < rank:
        return None
    d %= rank
    for v in views:
        u = _static_int(v.args[1])
        if u is None or not -rank <= u < rank or u % rank != d:
            return None
    return Node("stack.default", tuple(xs), ([In(k) for k in range(len(xs))], d), (), n.types)


FILL = "fill.Scalar"
FILL_READERS = ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor")


def fill_operand(rw: Rewriter, n: Node) -> Node | None:
    """``op(fill(t, c), y)`` / ``op(y, fill(t, c))`` -> the same op with ``full([], c)`` in the
    fill's place, when ``y`` has the result's type (so its shape alone sets the result's).

    ATen's C++ ``scalar - tensor`` is ``empty_like(b).fill_(a).sub_(b)``: the lazy device records
    the decomposition of ``silu_backward`` (CompositeImplicit's ``math_silu_backward``, which
    computes ``1 - sigmoid(x)`` that way) as ``empty_like``, ``fill`` and ``sub``: two ATen ops
    and a tensor of ones in memory between the fused kernels.  A one-element ``full`` is a
    literal to the fuser, so the SiLU gradient becomes one kernel.  Same values: the fill holds
    ``c`` cast to its dtype, as the 0-dim ``full`` of that dtype does, and a 0-dim operand of the
    other operand's dtype promotes to that dtype."""
    if len(n.inputs) != 2 or n.args[:2] not in ((In(0), In(1)), (In(1), In(0))):
        return None
    if any(k != "alpha" or isinstance(v, In) for k, v in n.kwargs) or len(n.args) != 2:
        return None
    out = n.types[0] if len(n.types) == 1 else None
    if out is None or not all(isinstance(d, int) for d in out.shape):
        return None
    for k in (0, 1):
        f = rw.node(n.inputs[k])
        if f.op != FILL or len(f.args) != 2 or f.args[0] != In(0) or f.kwargs:
            continue
        c = f.args[1]
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            continue
        if rw.type(n.inputs[k]) != out or rw.type(n.inputs[1 - k]) != out:
            continue
        lit = rw.add(
            Node("full.default", (), ([], c), (("dtype", out.dtype),), (TensorType((), out.dtype),))
        )
        inputs = list(n.inputs)
        inputs[k] = lit
        return n.with_(inputs=tuple(inputs))
    return None


_ADDC = {"div.Tensor": "addcdiv.default", "mul.Tensor": "addcmul.default"}


def addc_of_fma(rw: Rewriter, n: Node) -> Node | None:
    """``fma(t1 / t2, v, x)`` -> ``addcdiv(x, t1, t2, value=v)`` and ``fma(t1 * t2, v, x)`` ->
    ``addcmul(x, t1, t2, value=v)``, everything of one floating dtype.

    Dynamo writes ``x.addcdiv_(t1, t2, value=v)`` and ``x.addcmul_(...)`` (the updates of RMSprop,
    Adagrad, Adadelta, single-tensor Adam: the default optimizers on CPU run per parameter) as
    ``prims.fma(t1 op t2, v, x)``, where ATen's kernels compute ``x + v * t1 / t2`` and
    ``fma(v * t1, t2, x)``: products and quotients rounded in other places, so 310 of 1,185
    parameters of a compiled RMSprop and 38 of Adagrad's differed from eager's after three steps
    (every backend alike).  ``prims.fma`` is not user code; undone, the steps are eager's.  A
    ``v`` that Dynamo keeps as a 0-dim tensor (the step-dependent ones) cannot be addcdiv's
    Scalar: in float32 / float64 the kernel's own order is spelled out instead (each op rounds to
    the dtype, as the kernel's float arithmetic does); in bf16 / fp16 the rule does not apply."""
    if len(n.args) != 3 or n.args[0] != In(0) or n.kwargs or len(n.types) != 1:
        return None
    out, value, inner = n.types[0], n.args[1], rw.node(n.inputs[0])
    if inner.op not in _ADDC or inner.args != (In(0), In(1)) or inner.kwargs:
        return None
    (t1, t2), last = inner.inputs, n.args[2]
    if not isinstance(last, In) or out is None or not out.dtype.is_floating_point:
        return None
    x = n.inputs[last.k]
    if any(rw.type(v) is None or rw.type(v).dtype != out.dtype for v in (x, t1, t2)):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        args = (In(0), In(1), In(2))
        return Node(_ADDC[inner.op], (x, t1, t2), args, (("value", value),), n.types)
    v = n.inputs[value.k] if isinstance(value, In) else None
    vt = rw.type(v) if v is not None else None
    if vt is None or vt.shape != () or vt.dtype != out.dtype or out.dtype.itemsize < 4:
        return None
    scaled = rw.add(Node("mul.Tensor", (t1, v), (In(0), In(1)), (), (rw.type(t1),)))
    if inner.op == "mul.Tensor":  # fma(v * t1, t2, x)
        return Node("fma.default", (scaled, t2, x), (In(0), In(1), In(2)), (), n.types)
    q = rw.add(Node("div.Tensor", (scaled, t2), (In(0), In(1)), (), inner.types))
    return Node("add.Tensor", (x, q), (In(0), In(1)), (), n.types)


# --- the table: first matching rule wins ----------------------------------------------------
RULES: tuple[Rule, ...] = (
    # x * 1 -> x,  1 * x -> x
    Rule(
        "mul_one",
        ("mul.Tensor", "mul.Scalar"),
        partial(drop_neutral, neutral=1, commutes=True, alpha_scales_other=False),
    ),
    # x + (-0.0) -> x,  -0.0 + x -> x   (x + alpha*z -> x for finite alpha where alpha*z is -0.0;
    # any zero for integers: -0.0 + 0.0 is +0.0, so a float x + 0.0 stays)
    Rule(
        "add_zero",
        ("add.Tensor", "add.Scalar"),
        partial(drop_neutral, neutral=0, commutes=True, alpha_scales_other=True, zero_sign=1),
    ),
    # x - 0.0 -> x   (x - alpha*z -> x for finite alpha where alpha*z is +0.0; any zero for integers)
    Rule(
        "sub_zero",
        ("sub.Tensor", "sub.Scalar"),
        partial(drop_neutral, neutral=0, commutes=False, alpha_scales_other=True, zero_sign=-1),
    ),
    # x / 1 -> x   (true division only: div with a rounding mode is a different op)
    Rule(
        "div_one",
        ("div.Tensor", "div.Scalar"),
        partial(drop_neutral, neutral=1, commutes=False, alpha_scales_other=False),
    ),
    # x ** 1 -> x
    Rule(
        "pow_one",
        ("pow.Tensor_Scalar",),
        partial(drop_neutral, neutral=1, commutes=False, alpha_scales_other=False),
    ),
    # x ** 2 -> x * x   (same dtype only: an int tensor ** 2.0 is a float)
    Rule("pow_two", ("pow.Tensor_Scalar",), square),
    # -(-x) -> x
    Rule("neg_neg", ("neg.default",), neg_neg),
    # permute/transpose/t of permute/transpose/t -> one permute, or x when they cancel
    Rule("perm_perm", PERM_OPS, perm_of_perm),
    # permute in the identity order, transpose(x, d, d), t of a vector -> x
    Rule("perm_identity", PERM_OPS, perm_identity),
    # view/reshape of view/reshape -> one view (reshape if either was one) of the source
    Rule("view_chain", RESHAPES, view_chain),
    # view/reshape/expand/squeeze/slice/narrow/alias that keeps the shape -> x
    Rule("noop_view", NOOP_VIEWS, noop_view),
    # _to_copy to the same dtype, no device/layout/memory-format change -> x, when the copy
    # is not needed as a fresh tensor (no output, no mutation, nothing reads its strides --
    # unless x is itself a fresh dense result, whose copy has x's very strides)
    Rule("neutral_cast", ("_to_copy.default",), neutral_cast),
    # clone(x) -> x under the same conditions
    Rule("clone", ("clone.default",), drop_clone),
    # sum over a small dim that is not the last -> adds of selects (elementwise, fusable)
    Rule("small_sum", ("sum.dim_IntList",), small_sum),
    # squeeze of a view/reshape -> one view/reshape of the source
    Rule(
        "squeeze_of_reshape", ("squeeze.dims", "squeeze.dim", "squeeze.default"), squeeze_of_reshape
    ),
    # squeeze(slice(x, d, i, i + 1), [d]) -> select(x, d, i): one view call instead of two
    Rule("select_of_slice", ("squeeze.dims", "squeeze.dim"), select_of_slice),
    # cat of unsqueezes along the same new dim -> stack: one call instead of one per element
    Rule("stack_of_unsqueezes", ("cat.default",), stack_of_unsqueezes),
    # op(fill(empty_like(x), c), y) -> op(full([], c), y): a literal to the fuser (SiLU backward)
    Rule("fill_operand", FILL_READERS, fill_operand),
    # fma(t1 / t2, v, x) -> addcdiv(x, t1, t2, value=v), the same for * and addcmul: Dynamo's
    # forms of addcdiv_ / addcmul_ undone
    Rule("addc_of_fma", ("fma.default",), addc_of_fma),
)


def simplify(g: Graph) -> Graph:
    """Apply :data:`RULES` until nothing changes (at most ``rewrite.MAX_ITERS`` sweeps); a rule
    named ``simplify.NAME`` in ``config.disable_passes`` is skipped (same-process A/B of a rule)."""
    off = config.disabled_passes
    return apply_rules(g, tuple(r for r in RULES if f"simplify.{r.name}" not in off))
