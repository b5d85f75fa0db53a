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
"""

from __future__ import annotations

import math

import torch

from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType

OP = "nll_log_softmax_backward.default"
_LSM_BWD = "_log_softmax_backward_data.default"
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


def cross_entropy(g: Graph) -> Graph:
    """Rewrite each match (see the module docstring); the graph itself when there is none."""
    users = g.users
    outs = set(g.outputs)
    found: dict[int, tuple] = {}
    dead: set[int] = set()
    for i in range(len(g.nodes)):
        m = _match(g, users, outs, i)
        if m is not None:
            found[i] = m
            dead.update(m[4:])
    if not found:
        return g
    b = GraphBuilder()
    b.constants = list(g.constants)
    new: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if i in dead:
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
