"""Sink a permute through the elementwise ops it permutes, so they compute in its order.

``permute(f(x1, ..., xn), P)`` with ``f`` elementwise becomes ``f(permute(x1', P), ...,
permute(xn', P))`` (``xi'``: ``xi`` with leading size-1 dims added up to the result's rank, so
that it broadcasts as before).  Element ``j`` of both is ``f`` of the inputs' elements at the
permuted index, so the values are the same; what changes is the layout: the fused kernel that
computes ``f`` writes its output in the permuted order (contiguous), and reads its inputs through
the permuted views' strides.

It is done only where the permuted value is then copied because of its layout: every reader of
the permute is a reshape (``view``/``reshape``/``_unsafe_view``: merging permuted dims needs a copy)
or a ``cat`` (ATen's ``cat`` takes a serial memcpy path only when all its inputs are contiguous),
or an elementwise op (a permute sunk one op earlier: the chain then fuses into one kernel in the
permuted order instead of stopping at a materialized permuted input).
A ``roll`` along one dim (RoPE's rotation after ``rotate``) is passed the same way:
``permute(roll(x, s, d), P) -> roll(permute(x, P), s, P.index(d))`` (element ``j`` of both is
``x`` at the same rotated, permuted index), so that a permute sunk through RoPE's gradient does not
stop at the roll (the fuser would then write the rolled values out for the permuted kernel to read).
A roll of an ``expand`` along a dim the expand does not broadcast rolls the unexpanded source
instead: ``expand(roll(permute(v, P), s, P.index(d)), P(S))`` (RoPE's sin table, rolled as a
``(1, T, 1, D)`` table rather than written out at the heads' full shape).
Attention glue is the case it is for: the output of SDPA's CPU kernel is a permuted view of a
``(B, T, H, D)`` buffer; an elementwise op on it (nanoGPT's fully-masked-row term in the compile
frontend's attention rewrite, a gradient added to ``dv``) is written ``(B, H, T, D)``-contiguous,
then permuted back and reshaped to ``(B*T, C)`` (a copy) or concatenated with ``dq``/``dk`` (the slow
strided ``cat``).  After this pass the kernel writes ``(B, T, H, D)`` directly: the reshape is a
view and the ``cat`` reads contiguous inputs.

Needs: a well-formed graph; static shapes (symbolic sizes are left as they are).  Guarantees: same
output values, shapes and dtypes; the elementwise node moved is read by nothing but the permute
and is not a graph output; the permute is not a graph output (the caller's strides are kept); no
rewrite under mutation.  The original elementwise node is left dead for ``dce`` (run before the
first sweep and between sweeps here, so that chains of elementwise ops sink one op per sweep).
"""

from __future__ import annotations

from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.ops import Category, category, packet_of
from kiln.passes._util import Rewriter
from kiln.passes.dce import dce
from kiln.passes.rewrite import Rule, apply_rules

PERMUTE = "permute.default"
ROLL = "roll.default"
EXPAND = "expand.default"
# readers of a permuted value that copy it because of its layout
LAYOUT_READERS = frozenset(
    {"view.default", "reshape.default", "_unsafe_view.default", "cat.default"}
)
# elementwise ops that are not plain math on values (layout, fill, in-place or list forms)
_NOT_MATH = frozenset({"clone", "copy", "fill", "zero", "_to_copy", "to_copy"})
_KWARGS = frozenset({"alpha", "approximate", "rounding_mode"})
SWEEPS = 4


def _is_math(n: Node) -> bool:
    p = packet_of(n.op)
    try:
        if category(n.op) is not Category.ELEMENTWISE:
            return False
    except KeyError:
        return False
    if p in _NOT_MATH or p.startswith("_foreach") or len(n.types) != 1:
        return False
    if any(k not in _KWARGS or isinstance(v, In) for k, v in n.kwargs):
        return False
    return all(isinstance(a, (In, int, float, bool, str)) or a is None for a in n.args)


def _static(t: TensorType | None) -> bool:
    return t is not None and t.dtype is not None and all(isinstance(s, int) for s in t.shape)


def _readers_copy(rw: Rewriter) -> bool:
    """Whether every reader of the permute being rewritten copies it for its layout, or is itself
    elementwise (a permute sunk one op earlier: the op below it then joins the same kernel)."""
    g = rw.g
    users = g.users[rw.current]
    return bool(users) and all(
        g.nodes[u].op in LAYOUT_READERS or _is_math(g.nodes[u]) for u in users
    )


def _roll_dim(f: Node, rank: int) -> int | None:
    """The dim (``0 <= d < rank``) of a one-dim ``roll`` node with an int shift, or None."""
    if f.op != ROLL or f.kwargs or len(f.args) != 3 or f.args[0] != In(0):
        return None
    shifts, dims = f.args[1], f.args[2]
    if not isinstance(shifts, (list, tuple)) or not isinstance(dims, (list, tuple)):
        return None
    if len(shifts) != 1 or len(dims) != 1 or not isinstance(shifts[0], int):
        return None
    d = dims[0]
    if not isinstance(d, int) or not -rank <= d < rank:
        return None
    return d % rank


def sink_permute(rw: Rewriter, n: Node) -> Node | None:
    if rw.facts.has_mutation or rw.is_output or n.args[0] != In(0) or len(n.args) != 2:
        return None
    perm = n.args[1]
    y = n.inputs[0]
    f, yt, out_t = rw.node(y), rw.type(y), n.type
    if not _static(yt) or not _static(out_t):
        return None
    if f.op == ROLL:
        return _sink_through_roll(rw, n, f)
    if not _is_math(f):
        return None
    rank = len(yt.shape)
    if not isinstance(perm, (list, tuple)) or sorted(d % rank for d in perm) != list(range(rank)):
        return None
    perm = [d % rank for d in perm]
    if rank < 2 or perm == list(range(rank)) or rw.old_users(y) != 1:
        return None
    old_y = rw.old_id(y)
    if old_y is None or old_y in rw.facts.outputs or not _readers_copy(rw):
        return None
    inputs = []
    for x in f.inputs:
        xt = rw.type(x)
        if not _static(xt):
            return None
        if len(xt.shape) > rank:
            return None
        if len(xt.shape) == 0:  # a 0-d tensor broadcasts in any order
            inputs.append(x)
            continue
        if len(xt.shape) < rank:
            full = (1,) * (rank - len(xt.shape)) + tuple(xt.shape)
            vt = TensorType(full, xt.dtype)
            x = rw.add(Node("view.default", (x,), (In(0), list(full)), (), (vt,)))
            xt = vt
        pt = TensorType(tuple(xt.shape[d] for d in perm), xt.dtype)
        inputs.append(rw.add(Node(PERMUTE, (x,), (In(0), list(perm)), (), (pt,))))
    return f.with_(inputs=tuple(inputs), types=(out_t,))


def _sink_through_roll(rw: Rewriter, n: Node, f: Node) -> Node | None:
    """``permute(roll(x, s, d), P) -> roll(permute(x, P), s, P.index(d))``: the roll along the
    same dim, at its permuted position (RoPE's rotation, read by index in the kernel that the
    permute was sunk into, instead of a rolled copy the kernel reads)."""
    y = n.inputs[0]
    yt = rw.type(y)
    rank = len(yt.shape)
    perm = n.args[1]
    if not isinstance(perm, (list, tuple)) or sorted(d % rank for d in perm) != list(range(rank)):
        return None
    perm = [d % rank for d in perm]
    d = _roll_dim(f, rank)
    if d is None or rank < 2 or perm == list(range(rank)) or rw.old_users(y) != 1:
        return None
    old_y = rw.old_id(y)
    if old_y is None or old_y in rw.facts.outputs or not _readers_copy(rw):
        return None
    x = f.inputs[0]
    xt = rw.type(x)
    if not _static(xt) or xt.shape != yt.shape:
        return None
    shift = list(f.args[1])
    small = _expand_source(rw, x, d)
    if small is not None:  # roll the unexpanded table, expand the rolled one
        vt = rw.type(small)
        pvt = TensorType(tuple(vt.shape[k] for k in perm), vt.dtype)
        pv = rw.add(Node(PERMUTE, (small,), (In(0), list(perm)), (), (pvt,)))
        rv = rw.add(Node(ROLL, (pv,), (In(0), shift, [perm.index(d)]), (), (pvt,)))
        return Node(EXPAND, (rv,), (In(0), list(n.type.shape)), (), (n.type,))
    pt = TensorType(tuple(xt.shape[k] for k in perm), xt.dtype)
    px = rw.add(Node(PERMUTE, (x,), (In(0), list(perm)), (), (pt,)))
    return Node(ROLL, (px,), (In(0), shift, [perm.index(d)]), (), (n.type,))


def _expand_source(rw: Rewriter, x: int, d: int) -> int | None:
    """``v`` where ``x = expand(v, S)`` with ``v`` of the same rank and not broadcast along ``d``
    (a roll along ``d`` then commutes with the expand: RoPE's sin/cos table, expanded to the
    heads' shape, is rolled as the table), else None."""
    e = rw.node(x)
    if e.op != EXPAND or e.kwargs or len(e.args) < 2 or e.args[0] != In(0):
        return None
    v = e.inputs[0]
    vt, xt = rw.type(v), rw.type(x)
    if not _static(vt) or len(vt.shape) != len(xt.shape) or vt.dtype != xt.dtype:
        return None
    if vt.shape[d] != xt.shape[d]:
        return None
    if any(a != b and a != 1 for a, b in zip(vt.shape, xt.shape)):
        return None
    return v


RULES: tuple[Rule, ...] = (
    # permute(elementwise(x...)) read by reshapes/cat -> elementwise(permute(x)...)
    Rule("sink_permute", (PERMUTE,), sink_permute),
)


def sink_permutes(g: Graph) -> Graph:
    """Apply :data:`RULES`, with ``dce`` before and between sweeps (at most :data:`SWEEPS`
    sweeps): a dead reader of a permute (the contiguous copy ``layout`` replaced by a reshape of
    the permute) would otherwise keep it from sinking."""
    g = dce(g)
    for _ in range(SWEEPS):
        g2 = apply_rules(g, RULES, max_iters=1)
        if g2 is g:
            return g
        g = dce(g2)
    return g
