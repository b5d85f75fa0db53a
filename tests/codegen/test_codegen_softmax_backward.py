"""Generated (log_)softmax backward row kernels against ATen and eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.cpp import build
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.codegen.interpreter import Interpreter

F32 = torch.float32


@pytest.mark.parametrize(
    "op", ["_softmax_backward_data.default", "_log_softmax_backward_data.default"]
)
@pytest.mark.parametrize("shape", [(3, 5, 37), (129,), (4, 1)])
def test_kernel_matches_aten(op, shape):
    b = GraphBuilder()
    t = TensorType(shape, F32)
    dy, y = b.input(t), b.input(t)
    out = b.add(Node(op, (dy, y), (In(0), In(1), -1, F32), (), (t,)))
    g = b.build([out])
    x = torch.randn(shape)
    yv = torch.softmax(x, -1) if op.startswith("_softmax") else torch.log_softmax(x, -1)
    xs = [torch.randn(shape), yv]
    run, info = build(g)
    assert [k["kind"] for k in info["kernels"]] == ["softmax_backward"]
    torch.testing.assert_close(run(xs)[0], Interpreter(g)(xs)[0])


def test_lazy_attention_and_cross_entropy_grads_match_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.Linear(29, 11))
    dev = kiln.device()
    lazy = copy.deepcopy(model).to(dev)
    x, y = torch.randn(2, 7, 13), torch.randint(0, 11, (14,))

    def loss(m, d):
        h = m(x.to(d))
        a = torch.softmax(h @ h.transpose(-1, -2), -1) @ h
        return F.cross_entropy(a.reshape(14, 11), y.to(d))

    loss(model, "cpu").backward()
    loss(lazy, dev).backward()
    kiln.mark_step()
    for a, b in zip(lazy.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad)
