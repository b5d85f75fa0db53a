"""Generated kernels against eager ATen: odd sizes, broadcasting, non-contiguous inputs, reductions."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import F32, op, run_both, t

from kiln.ir.graph import GraphBuilder, In


def _chain_graph(shape: tuple, bias_shape: tuple):
    """x*s + bias -> gelu -> where(x > 0, ., -.) ; exp-sum over last dim; bias-grad style sum."""
    b = GraphBuilder()
    x = b.input(t(shape))
    bias = b.input(t(bias_shape))
    s = b.scalar("float")
    m = op(b, "mul.Tensor", (x, s), (In(0), In(1)), t(shape))
    a = op(b, "add.Tensor", (m, bias), (In(0), In(1)), t(shape))
    ge = op(b, "gelu.default", (a,), (In(0),), t(shape), approximate="none")
    gt = op(b, "gt.Scalar", (x,), (In(0), 0.0), t(shape, torch.bool))
    ng = op(b, "neg.default", (ge,), (In(0),), t(shape))
    w = op(b, "where.self", (gt, ge, ng), (In(0), In(1), In(2)), t(shape))
    outs = [w]
    if len(shape) >= 1:
        e = op(b, "exp.default", (w,), (In(0),), t(shape))
        rs = op(b, "sum.dim_IntList", (e,), (In(0), [-1], True), t(shape[:-1] + (1,)))
        outs.append(rs)
    if len(shape) >= 2:
        cs = op(b, "sum.dim_IntList", (ge,), (In(0), list(range(len(shape) - 1))), t(shape[-1:]))
        outs.append(cs)
    return b.build(outs)


@pytest.mark.parametrize(
    "shape", [(1,), (7,), (33,), (1023,), (1, 1), (7, 33), (3, 5, 33), (2, 1023)]
)
def test_pointwise_and_reductions_match_eager(shape):
    g = _chain_graph(shape, shape[-1:])
    inputs = [torch.randn(shape), torch.randn(shape[-1:]), 0.75]
    expected, got, info = run_both(g, inputs)
    assert info["kernels"], "nothing was fused"
    for e, k in zip(expected, got):
        assert k.shape == e.shape
        torch.testing.assert_close(k, e)


def test_different_sizes_reuse_one_kernel():
    g1 = _chain_graph((4, 33), (33,))
    g2 = _chain_graph((9, 33), (33,))
    _, _, i1 = run_both(g1, [torch.randn(4, 33), torch.randn(33), 1.0])
    _, _, i2 = run_both(g2, [torch.randn(9, 33), torch.randn(33), 1.0])
    assert [k["source"] for k in i1["kernels"]] == [k["source"] for k in i2["kernels"]]


@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded"])
def test_non_contiguous_inputs(kind):
    base = torch.randn(33, 16)
    if kind == "transposed":
        x = base.t()  # [16, 33], strides (1, 16)
    elif kind == "sliced":
        x = torch.randn(16, 70)[:, 3:36]  # [16, 33], row stride 70
    else:
        x = torch.randn(16, 1).expand(16, 33)
    bias = torch.randn(66)[::2]  # [33] with stride 2
    g = _chain_graph((16, 33), (33,))
    expected, got, _ = run_both(g, [x, bias, -0.5])
    for e, k in zip(expected, got):
        torch.testing.assert_close(k, e)


def test_broadcast_row_and_column_inputs():
    b = GraphBuilder()
    col = b.input(t((5, 1)))
    row = b.input(t((1, 33)))
    scal = b.input(t(()))
    a = op(b, "sub.Tensor", (col, row), (In(0), In(1)), t((5, 33)), alpha=2)
    m = op(b, "mul.Tensor", (a, scal), (In(0), In(1)), t((5, 33)))
    d = op(b, "div.Tensor", (m, col), (In(0), In(1)), t((5, 33)))
    g = b.build([d])
    inputs = [torch.randn(5, 1), torch.randn(1, 33), torch.tensor(1.5)]
    expected, got, info = run_both(g, inputs)
    assert len(info["kernels"]) == 1
    torch.testing.assert_close(got[0], expected[0])


@pytest.mark.parametrize("fn", ["_softmax.default", "_log_softmax.default"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 4, 33), (1, 1023)])
def test_softmax_with_prologue(fn, shape):
    b = GraphBuilder()
    x = b.input(t(shape))
    mask = b.input(t(shape[-1:], torch.bool))
    sc = op(b, "mul.Tensor", (x,), (In(0), 0.125), t(shape))
    mf = op(b, "masked_fill.Scalar", (sc, mask), (In(0), In(1), float("-inf")), t(shape))
    sm = op(b, fn, (mf,), (In(0), -1, False), t(shape))
    amax = op(b, "amax.default", (x,), (In(0), [-1], False), t(shape[:-1]))
    mean = op(b, "mean.dim", (x,), (In(0), [-1], True), t(shape[:-1] + (1,)))
    g = b.build([sm, amax, mean])
    m = torch.rand(shape[-1:]) > 0.5
    m[0] = False
    expected, got, info = run_both(g, [torch.randn(shape), m])
    assert any(k["kind"] == "rows" for k in info["kernels"])
    for e, k in zip(expected, got):
        torch.testing.assert_close(k, e)


def test_int_and_bool_dtypes():
    b = GraphBuilder()
    i = b.input(t((7, 5), torch.int64))
    f = b.input(t((7, 5)))
    eq = op(b, "eq.Scalar", (i,), (In(0), 3), t((7, 5), torch.bool))
    nt = op(b, "logical_not.default", (eq,), (In(0),), t((7, 5), torch.bool))
    cv = op(b, "_to_copy.default", (i,), (In(0),), t((7, 5)), dtype=F32)
    w = op(b, "where.self", (nt, cv, f), (In(0), In(1), In(2)), t((7, 5)))
    ad = op(b, "add.Tensor", (i,), (In(0), 2), t((7, 5), torch.int64))
    g = b.build([w, nt, ad])
    inputs = [torch.randint(0, 6, (7, 5)), torch.randn(7, 5)]
    expected, got, _ = run_both(g, inputs)
    for e, k in zip(expected, got):
        assert k.dtype == e.dtype
        torch.testing.assert_close(k, e)
