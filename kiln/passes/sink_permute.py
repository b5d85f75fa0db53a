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
Attention glue is the case it is for: the output of SDPA's CPU kernel is a permuted view of a
``(B, T, H, D)`` buffer; an elementwise op on it (nanoGPT's fully-masked-row term in the compile
frontend's attention rewrite, a gradient added to ``dv``) is written ``(B, H, T, D)``-contiguous,
then permuted back and reshaped to ``(B*T, C)`` (a copy) or concatenated with ``dq``/``dk`` (the slow
strided ``cat``).  After this pass the kernel writes ``(B, T, H, D)`` directly: the reshape is a
view and the ``cat`` reads contiguous inputs.

Needs: a well-formed graph; static shapes (symbolic sizes are left as they are).  Guarantees: same
output values, shapes and dtypes; the elementwise node moved is read by nothing but the permute
and is not a graph output; the permute is not a graph output (the caller's strides are kept); no
rewrite under mutation.  The original elementwise node is left dead for ``dce`` (run between
sweeps here, so that chains of elementwise ops sink one op per sweep).
"""

from __future__ import annotations

from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.ops import Category, category, packet_of
from kiln.passes._util import Rewriter
from kiln.passes.dce import dce
from kiln.passes.rewrite import Rule, apply_rules

PERMUTE = "permute.default"
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


def sink_permute(rw: Rewriter, n: Node) -> Node | None:
    if rw.facts.has_mutation or rw.is_output or n.args[0] != In(0) or len(n.args) != 2:
        return None
    perm = n.args[1]
    y = n.inputs[0]
    f, yt, out_t = rw.node(y), rw.type(y), n.type
    if not _static(yt) or not _static(out_t) or not _is_math(f):
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


RULES: tuple[Rule, ...] = (
    # permute(elementwise(x...)) read by reshapes/cat -> elementwise(permute(x)...)
    Rule("sink_permute", (PERMUTE,), sink_permute),
)


def sink_permutes(g: Graph) -> Graph:
    """Apply :data:`RULES`, with ``dce`` between sweeps (at most :data:`SWEEPS` sweeps)."""
    for _ in range(SWEEPS):
        g2 = apply_rules(g, RULES, max_iters=1)
        if g2 is g:
            return g
        g = dce(g2)
    return g
