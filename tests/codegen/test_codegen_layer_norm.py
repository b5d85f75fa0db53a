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
