"""The backend stays flat over many compiles in one process.

AOTAutograd wraps the backward compiler it is given in place on every call; a compiler shared by
every graph nested one more wrapper per compiled graph, until a long session (the test suite, a
notebook compiling many models) hit RecursionError inside torch.compile.
"""

from __future__ import annotations

import sys

import torch

import kiln  # noqa: F401 - registers the backend
from kiln.frontends.compile import backend


def test_backward_compiles_do_not_nest(monkeypatch):
    depths: list[int] = []
    real = backend.compile_graph

    def counting(g):
        frame, depth = sys._getframe(), 0
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        depths.append(depth)
        return real(g)

    monkeypatch.setattr(backend, "compile_graph", counting)
    torch._dynamo.reset()
    ops = [torch.tanh, torch.sigmoid, torch.sin, torch.cos, torch.exp, torch.atan]
    for op in ops:
        # a different op each time: a new Dynamo graph, forward and backward compiled

        def f(x, op=op):
            return op(x * 1.5).sum()

        x = torch.randn(4, 3, requires_grad=True)
        torch.compile(f, backend="kiln")(x).backward()
        xe = x.detach().clone().requires_grad_(True)
        f(xe).backward()
        torch.testing.assert_close(x.grad, xe.grad)
    torch._dynamo.reset()
    assert len(depths) >= 12  # forward and backward of each
    # flat: the shared compiler grew two frames per graph (69, 68, 71, 70, ... 79, 78)
    assert max(depths) - min(depths) <= 4, depths
