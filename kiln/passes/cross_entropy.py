"""Cross-entropy backward: the nll_loss one-hot and the log-softmax backward as one node.

PyTorch's decomposition of ``nll_loss_backward`` (what the compile frontend's backward graphs
hold for ``F.cross_entropy``, transformers' causal-LM and masked-LM losses included) writes the
gradient of the loss as a one-hot matrix: a zero fill of ``[R, V]``, a ``scatter`` of ``-1`` at
each row's target, and a product with the per-row scale (``grad / total_weight`` where the target
is not ``ignore_index``, else 0); ``_log_softmax_backward_data`` then reads that matrix back::

    %z = full_like(%y, 0)                       : f32[R,V]
    %s = scatter.value(%z, 1, %t, -1.0)         : f32[R,V]     %t: i64[R,1], the safe targets
    %m = mul.Tensor(%s, %w)                     : f32[R,V]     %w: f32[R,1] (or [], [1], [1,1])
    %d = _log_softmax_backward_data(%m, %y, 1, f32)
  becomes
    %c = gather.default(%y, 1, %t)              : f32[R,1]     validates %t (ATen's error)
    %d = nll_log_softmax_backward.default(%y, %t, %w, %c, -1.0)

``nll_log_softmax_backward`` (record and reference in :mod:`kiln.ir.ops`) computes the same
values from ``y``, the targets and the scale alone: the C++ backend runs it as one row kernel
(:mod:`kiln.codegen.cpp.cross_entropy`) that reads ``y`` once and writes the gradient once,
instead of a fill, a scatter copy, a product and the row kernel (four passes over ``[R, V]``).
The ``gather`` keeps the decomposition's one check: a target outside ``[0, V)`` raises
ATen's "index out of bounds" error (as the ``scatter`` did) before the kernel runs; it reads one value per
row.

Needs: a typed graph in topological order (the generic pipeline done; this pass is part of the
C++ backend's own passes, before ``fuse``).  Guarantees: same output values, shapes and dtypes;
only float32 ``[R, V]`` tensors, dim 1 (or -1), a scatter of a Python number into zeros whose
index is ``[R, 1]`` int64, a scale that is the same for every column of a row, and fill, scatter
and product each read by nothing but the next node (and not graph outputs) are rewritten; the
nodes replaced are dropped; everything else is left as it is.  ``KILN_DISABLE_PASSES=
cross_entropy`` turns it off.

The lazy device's form.  The kiln device records the backward ops autograd runs, undecomposed
(issue 10): ``nll_loss_backward`` writes the one-hot gradient as an ATen op, then the row kernel
reads it::

    %g = nll_loss_backward.default(%go, %y, %t, None, reduction, ignore, %tw)   %t: i64[R]
    %d = _log_softmax_backward_data(%g, %y, 1, f32)
  becomes (``[R, 1]`` nodes the fuser makes one small kernel of)
    %u = unsqueeze.default(%t, 1)                            : i64[R,1]
    %k = ne.Scalar(%u, ignore)                               : b8[R,1]
    %s = mul.Tensor(%u, %k)                                  : i64[R,1]   0 where ignored
    %w = where.self(%k, %go / %tw | %go | unsqueeze(%go, 1), 0.0)         mean | sum | none
    %c = gather.default(%y, 1, %s)
    %d = nll_log_softmax_backward.default(%y, %s, %w, %c, -1.0)

the same values as eager: ATen's ``nll_loss_backward`` writes ``-(go / tw)`` (mean), ``-go``
(sum) or ``-go[r]`` (none) at each row's target and nothing in an ignored row, which is
``-1.0 * w`` at the (safe) target and ``0 * w`` with ``w = 0`` in ignored rows (``-0.0`` in an
ignored row's column 0 where eager has ``0.0``).  One difference, at an infinite or NaN incoming
gradient: eager's row is ``-inf`` at the target and ``0`` elsewhere before the row kernel, the
fused kernel's ``0 * inf`` elsewhere is NaN (compile mode's decomposition does the same).  Only
``weight=None``, 2-D float32 ``y`` with a static number of classes (at least 1), a ``nll_loss_backward`` read by nothing but the row kernel
(and not a graph output) that reads the same ``y``.  ``KILN_DISABLE_PASSES=cross_entropy.lazy``
turns this form off alone.
"""

from __future__ import annotations

import math

import torch

from kiln.config import config
from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType

OP = "nll_log_softmax_backward.default"
_LSM_BWD = "_log_softmax_backward_data.default"
_NLL_BWD = "nll_loss_backward.default"
_REDUCTIONS = (0, 1, 2)  # none, mean, sum
_ZEROS = frozenset({"full_like.default", "zeros_like.default", "zeros.default", "full.default"})
F32 = torch.float32


def _f32(t: TensorType | None) -> bool:
    return t is not None and t.dtype == F32


def _is_zeros(n: Node) -> bool:
    """A fresh float32 tensor of zeros (the decomposition's ``zeros_like(self)``)."""
    if n.op not in _ZEROS or not _f32(n.type):
        return False
    if n.op in ("full_like.default", "full.default"):
        v = n.args[1] if len(n.args) >= 2 else None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != 0:
            return False
        if math.copysign(1.0, v) < 0:  # -0.0: its products keep the sign
            return False
    if any(isinstance(v, In) for _, v in n.kwargs):
        return False
    dt = n.kwarg("dtype")
    return dt is None or dt == F32


def _row_constant(t: TensorType | None, rows: object) -> bool:
    """A float32 scale the same for every column: ``[]``, ``[1]``, ``[1, 1]`` or ``[R, 1]``."""
    if not _f32(t):
        return False
    s = tuple(t.shape)
    return s in ((), (1,), (1, 1)) or s == (rows, 1)


def _match(g: Graph, users: tuple, outs: set, i: int) -> tuple | None:
    """(y, target, scale, value, fill, scatter, mul) when node ``i`` ends the pattern."""
    d = g.nodes[i]
    if d.op != _LSM_BWD or len(d.args) != 4 or d.kwargs or d.args[0] != In(0):
        return None
    if d.args[1] != In(1) or d.args[3] != F32 or not _f32(d.type):
        return None
    shape = tuple(d.type.shape)
    if len(shape) != 2 or d.args[2] not in (1, -1):
        return None
    m_id, y_id = d.inputs
    m = g.nodes[m_id]
    if m.op != "mul.Tensor" or len(m.inputs) != 2 or m.kwargs or m.args != (In(0), In(1)):
        return None
    if m.inputs[0] == m.inputs[1] or tuple(g.nodes[y_id].type.shape) != shape:
        return None
    for k in (0, 1):
        s_id, w_id = m.inputs[k], m.inputs[1 - k]
        s = g.nodes[s_id]
        if s.op == "scatter.value" and _row_constant(g.nodes[w_id].type, shape[0]):
            break
    else:
        return None
    if len(s.args) != 4 or s.kwargs or s.args[0] != In(0) or s.args[2] != In(1):
        return None
    value = s.args[3]
    if s.args[1] not in (1, -1) or isinstance(value, (bool, In)):
        return None
    if not isinstance(value, (int, float)):
        return None
    z_id, t_id = s.inputs
    t = g.nodes[t_id].type
    if t is None or t.dtype != torch.int64 or tuple(t.shape) != (shape[0], 1):
        return None
    if not _is_zeros(g.nodes[z_id]) or tuple(g.nodes[z_id].type.shape) != shape:
        return None
    for j, reader in ((z_id, s_id), (s_id, m_id), (m_id, i)):
        if j in outs or users[j] != (reader,):
            return None
    return y_id, t_id, w_id, float(value), z_id, s_id, m_id


def _value(n: Node, pos: int) -> int | None:
    """The graph value at argument ``pos`` of ``n`` (None when it is not one)."""
    a = n.args[pos] if pos < len(n.args) else None
    return n.inputs[a.k] if isinstance(a, In) else None


def _match_lazy(g: Graph, users: tuple, outs: set, i: int) -> tuple | None:
    """(y, target, go, total_weight, reduction, ignore, nll) when node ``i`` is the log-softmax
    backward of a whole ``nll_loss_backward`` (the lazy device's form)."""
    d = g.nodes[i]
    if d.op != _LSM_BWD or len(d.args) != 4 or d.kwargs or d.args[3] != F32:
        return None
    if not _f32(d.type) or len(d.type.shape) != 2 or d.args[2] not in (1, -1):
        return None
    vocab = d.type.shape[1]
    if not isinstance(vocab, int) or vocab < 1:  # an ignored row's safe target 0 must exist
        return None
    n_id, y_id = _value(d, 0), _value(d, 1)
    if n_id is None or y_id is None or n_id in outs or users[n_id] != (i,):
        return None
    n = g.nodes[n_id]
    if n.op != _NLL_BWD or len(n.args) != 7 or n.kwargs or n.args[3] is not None:
        return None
    go, y, t, tw = (_value(n, k) for k in (0, 1, 2, 6))
    reduction, ignore = n.args[4], n.args[5]
    if y != y_id or None in (go, t, tw) or reduction not in _REDUCTIONS:
        return None
    if not isinstance(ignore, int) or isinstance(ignore, bool):
        return None
    rows = d.type.shape[0]
    tt, got, twt = g.nodes[t].type, g.nodes[go].type, g.nodes[tw].type
    if tt is None or tt.dtype != torch.int64 or tuple(tt.shape) != (rows,):
        return None
    if not _f32(got) or not _f32(twt) or tuple(twt.shape) != ():
        return None
    if tuple(got.shape) != ((rows,) if reduction == 0 else ()):
        return None
    return y_id, t, go, tw, reduction, ignore, n_id


def _rewrite_lazy(b: GraphBuilder, m: tuple, rows: object, types: tuple) -> int:
    """The nodes that replace a lazy-form match ``m`` (already mapped to ``b``'s ids)."""
    y, t, go, tw, reduction, ignore = m
    col = (rows, 1)
    u = b.add(Node("unsqueeze.default", (t,), (In(0), 1), (), (TensorType(col, torch.int64),)))
    keep = b.add(Node("ne.Scalar", (u,), (In(0), ignore), (), (TensorType(col, torch.bool),)))
    safe = b.add(Node("mul.Tensor", (u, keep), (In(0), In(1)), (), (TensorType(col, torch.int64),)))
    if reduction == 1:  # mean: ATen's grad_output / total_weight
        go = b.add(Node("div.Tensor", (go, tw), (In(0), In(1)), (), (TensorType((), F32),)))
    elif reduction == 0:
        go = b.add(Node("unsqueeze.default", (go,), (In(0), 1), (), (TensorType(col, F32),)))
    zero = b.add(Node("full.default", (), ([], 0.0), (("dtype", F32),), (TensorType((), F32),)))
    w = b.add(
        Node("where.self", (keep, go, zero), (In(0), In(1), In(2)), (), (TensorType(col, F32),))
    )
    checked = b.add(
        Node("gather.default", (y, safe), (In(0), 1, In(1)), (), (TensorType(col, F32),))
    )
    return b.add(Node(OP, (y, safe, w, checked), (In(0), In(1), In(2), In(3), -1.0), (), types))


def cross_entropy(g: Graph) -> Graph:
    """Rewrite each match (see the module docstring); the graph itself when there is none."""
    users = g.users
    outs = set(g.outputs)
    found: dict[int, tuple] = {}
    lazy: dict[int, tuple] = {}
    dead: set[int] = set()
    lazy_on = "cross_entropy.lazy" not in config.disabled_passes
    for i in range(len(g.nodes)):
        m = _match(g, users, outs, i)
        if m is not None:
            found[i] = m
            dead.update(m[4:])
            continue
        m = _match_lazy(g, users, outs, i) if lazy_on else None
        if m is not None:
            lazy[i] = m
            dead.add(m[6])
    if not found and not lazy:
        return g
    b = GraphBuilder()
    b.constants = list(g.constants)
    new: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if i in dead:
            continue
        if i in lazy:
            y, t, go, tw, reduction, ignore, _ = lazy[i]
            ids = (new[y], new[t], new[go], new[tw], reduction, ignore)
            new[i] = _rewrite_lazy(b, ids, n.type.shape[0], n.types)
            continue
        if i not in found:
            new[i] = b.add(n.with_(inputs=tuple(new[j] for j in n.inputs)))
            continue
        y, t, w, value = (new[found[i][0]], new[found[i][1]], new[found[i][2]], found[i][3])
        rows = g.nodes[found[i][1]].type.shape[0]
        checked = b.add(
            Node("gather.default", (y, t), (In(0), 1, In(1)), (), (TensorType((rows, 1), F32),))
        )
        new[i] = b.add(
            Node(OP, (y, t, w, checked), (In(0), In(1), In(2), In(3), value), (), n.types)
        )
    return b.build(new[o] for o in g.outputs)
