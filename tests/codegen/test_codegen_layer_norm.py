"""Generated layer norm kernels (forward: out, mean, rstd; backward: dx, dw, db) against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from kiln_codegen_testlib import on_configured_backend

import kiln
from kiln.codegen.cpp import build
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.codegen.interpreter import Interpreter

F32 = torch.float32


def _t(shape):
    return TensorType(tuple(shape), F32)


def _ln_graph(shape, affine: bool, eps: float):
    b = GraphBuilder()
    x = b.input(_t(shape))
    ins, args = [x], [In(0), [shape[-1]], None, None, eps]
    if affine:
        ins += [b.input(_t(shape[-1:])), b.input(_t(shape[-1:]))]
        args[2:4] = [In(1), In(2)]
    stat = _t(tuple(shape[:-1]) + (1,))
    ln = b.add(
        Node("native_layer_norm.default", tuple(ins), tuple(args), (), (_t(shape), stat, stat))
    )
    outs = [b.getitem(ln, k) for k in range(3)]
    return b.build(outs)


@pytest.mark.parametrize("shape,affine", [((3, 5, 37), True), ((7, 129), False), ((1, 1), True)])
def test_forward_kernel_matches_aten(shape, affine):
    g = _ln_graph(shape, affine, 1e-5)
    xs = [torch.randn(shape) * 3 + 1]
    if affine:
        xs += [torch.randn(shape[-1]), torch.randn(shape[-1])]
    run, info = build(g)
    assert [k["kind"] for k in info["kernels"]] == ["layer_norm"]
    for got, want in zip(run(xs), Interpreter(g)(xs)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_forward_backward_through_compile():
    torch._dynamo.reset()

    def f(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b).tanh()

    xs = [torch.randn(5, 11, 67), torch.randn(67), torch.randn(67)]

    def grads(fn):
        ts = [x.clone().requires_grad_(True) for x in xs]
        out = fn(*ts)
        return [out.detach(), *torch.autograd.grad(out.sum(), ts)]

    for a, e in zip(grads(torch.compile(f, backend="kiln")), grads(f)):
        torch.testing.assert_close(a, e)


def test_lazy_layer_norm_forward_backward_uses_kernels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(9, 45), torch.nn.LayerNorm(45), torch.nn.Linear(45, 3)
    )
    dev = kiln.device()
    lazy = copy.deepcopy(model).to(dev)
    x = torch.randn(3, 7, 9)
    with on_configured_backend():  # with cpp: generated kernels ran
        for m, d in ((model, "cpu"), (lazy, dev)):
            m(x.to(d)).square().mean().backward()
        kiln.mark_step()
    for a, b in zip(lazy.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad)


def _ln_backward_graph(shape, affine: bool):
    b = GraphBuilder()
    n = shape[-1]
    stat = tuple(shape[:-1]) + (1,)
    ins = [b.input(_t(shape)), b.input(_t(shape)), b.input(_t(stat)), b.input(_t(stat))]
    args = [In(0), In(1), [n], In(2), In(3), None, None, [True, True, True]]
    if affine:
        ins += [b.input(_t((n,))), b.input(_t((n,)))]
        args[5:7] = [In(4), In(5)]
    types = (_t(shape), _t((n,)), _t((n,)))
    ln = b.add(Node("native_layer_norm_backward.default", tuple(ins), tuple(args), (), types))
    return b.build([b.getitem(ln, k) for k in range(3)])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "shape,affine",
    [
        ((15, 33), True),
        ((16, 7), True),
        ((17, 130), False),
        ((3, 100, 257), True),
        ((600, 64), True),
    ],
)
def test_backward_kernel_vs_float64_over_row_blocks(shape, affine, threads):
    """The backward kernel's float column sums are flushed into double every 16 rows, per thread:
    row counts below, at and past a block, many blocks over two threads (600 x 64 is above the
    parallel threshold), each result at least as close to float64 as ATen's."""
    g = torch.Generator().manual_seed(sum(shape))
    n = shape[-1]
    x = torch.randn(shape, generator=g) * 2 + 0.5
    dy = torch.randn(shape, generator=g)
    w, bias = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, mean, rstd = torch.native_layer_norm(x, [n], w if affine else None, None, 1e-5)
    inputs = [dy, x, mean, rstd] + ([w, bias] if affine else [])
    run, info = build(_ln_backward_graph(shape, affine))
    assert [k["kind"] for k in info["kernels"]] == ["layer_norm_backward"]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run(inputs)
    finally:
        torch.set_num_threads(prev)
    w64 = w.double() if affine else None
    _, m64, r64 = torch.native_layer_norm(x.double(), [n], w64, None, 1e-5)
    mask = [True, affine, affine]  # ATen: weight and bias gradients only of an affine norm
    ref = torch.ops.aten.native_layer_norm_backward(
        dy.double(), x.double(), [n], m64, r64, w64, bias.double() if affine else None, mask
    )
    aten = torch.ops.aten.native_layer_norm_backward(
        dy, x, [n], mean, rstd, w if affine else None, bias if affine else None, mask
    )
    for name, k, a, r in zip(("x", "weight", "bias"), got, aten, ref):
        if r is None:  # not requested of ATen (no weight)
            continue
        scale = float(r.abs().max())
        k_err, a_err = float((k.double() - r).abs().max()), float((a.double() - r).abs().max())
        assert k_err <= max(a_err, 1e-6 * scale), f"{name}: kiln {k_err:.3g} aten {a_err:.3g}"


def test_backward_kernel_constant_gradient_rows_are_exact():
    """Rows of equal values (rstd = 1/sqrt(eps), ~316) under a gradient equal along the row: the
    input gradient is exactly 0 (``g - mean(g)`` is 0 before rstd multiplies it)."""
    shape = (40, 24)
    x = torch.full(shape, 0.3) + torch.arange(40.0).unsqueeze(1)
    dy = torch.full(shape, 0.1) * torch.linspace(-1, 1, 40).unsqueeze(1)
    w = torch.full((24,), 0.7)
    _, mean, rstd = torch.native_layer_norm(x, [24], w, None, 1e-5)
    run, _ = build(_ln_backward_graph(shape, True))
    dx, dw, db = run([dy, x, mean, rstd, w, torch.zeros(24)])
    assert torch.equal(dx, torch.zeros(shape))
    assert torch.equal(dw, torch.zeros(24))
    torch.testing.assert_close(db, dy.sum(0))
