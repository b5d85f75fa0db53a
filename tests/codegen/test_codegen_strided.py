"""Inputs reached through layout-changing views (permute, slice, expand) are read through their
strides inside the kernel (no contiguous copy first), and the results match eager."""

from __future__ import annotations

import torch
from kiln_codegen_testlib import op, run_both, t

from kiln.ir.graph import GraphBuilder, In
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)


def _attention_like():
    """x:[512,96] -> view [8,64,3,4] -> select -> permute [8,4,64,...]; (q * 2 + k).clone()."""
    b = GraphBuilder()
    x = b.input(t((64, 3 * 4 * 8)))
    v = op(b, "view.default", (x,), (In(0), [8, 8, 3, 4, 8]), t((8, 8, 3, 4, 8)))
    q = op(b, "select.int", (v,), (In(0), 2, 0), t((8, 8, 4, 8)))
    k = op(b, "select.int", (v,), (In(0), 2, 1), t((8, 8, 4, 8)))
    qp = op(b, "permute.default", (q,), (In(0), [0, 2, 1, 3]), t((8, 4, 8, 8)))
    kp = op(b, "permute.default", (k,), (In(0), [0, 2, 1, 3]), t((8, 4, 8, 8)))
    m = op(b, "mul.Tensor", (qp,), (In(0), 2.0), t((8, 4, 8, 8)))
    a = op(b, "add.Tensor", (m, kp), (In(0), In(1)), t((8, 4, 8, 8)))
    c = op(b, "clone.default", (a,), (In(0),), t((8, 4, 8, 8)))
    return b.build([c])


def test_fuser_marks_inputs_behind_permutes_as_strided():
    g = fuse(_attention_like())
    fused = [n for n in g.nodes if n.op == "fused"]
    assert len(fused) == 1
    assert fused[0].kwarg("strided") == (0, 1)  # both inputs come out of a permute


def test_strided_reads_match_eager():
    x = torch.randn(64, 96)
    expected, got, _ = run_both(_attention_like(), [x])
    torch.testing.assert_close(got[0], expected[0])
    assert got[0].is_contiguous()


def test_expanded_and_sliced_inputs_match_eager():
    b = GraphBuilder()
    x = b.input(t((6, 10)))
    y = b.input(t((10,)))
    s = op(b, "slice.Tensor", (x,), (In(0), 1, 2, 9), t((6, 7)))
    e = op(b, "slice.Tensor", (y,), (In(0), 0, 0, 7), t((7,)))
    ee = op(b, "expand.default", (e,), (In(0), [6, 7]), t((6, 7)))
    o = op(b, "mul.Tensor", (s, ee), (In(0), In(1)), t((6, 7)))
    r = op(b, "exp.default", (o,), (In(0),), t((6, 7)))
    g = b.build([r])
    assert fuse(g).nodes[-1].kwarg("strided")
    x_val, y_val = torch.randn(6, 10), torch.randn(10)
    expected, got, _ = run_both(g, [x_val, y_val])
    torch.testing.assert_close(got[0], expected[0])
