"""Dynamo graphs that compute nothing run as Dynamo wrote them, not through AOTAutograd and Kiln.

A ``with torch.autocast(...)`` block whose body graph-breaks at once (GPT-2's loss logs a warning
first thing) leaves Dynamo a graph of the two autocast switches alone; such graphs now run as
their own Python (``trivial_graphs``), with eager's autocast behaviour around them."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln import metrics


def _h(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()  # the block's first statement breaks the graph
    return (x @ w).relu() + 1


@pytest.mark.parametrize("enabled", [False, True])
def test_autocast_block_broken_at_once_runs_as_eager(enabled):
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = _h(x, w)
        return y.float().sum()

    torch._dynamo.reset()
    before = metrics.get("trivial_graphs")
    g = torch.compile(f, backend="kiln")
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    want = f(x, w)
    want.backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    for _ in range(2):  # the second call runs the compiled graphs again
        got = g(x, w)
        torch.testing.assert_close(got, want)
    got.backward()
    torch.testing.assert_close(x.grad, grads[0])
    torch.testing.assert_close(w.grad, grads[1])
    assert metrics.get("trivial_graphs") - before >= 1
    assert not torch.is_autocast_enabled("cpu")  # the switches left autocast as they found it


def test_graphs_that_compute_are_not_trivial():
    torch._dynamo.reset()
    before = metrics.get("trivial_graphs")
    g = torch.compile(lambda x: x.sin() * 2, backend="kiln")
    torch.testing.assert_close(g(torch.ones(3)), torch.ones(3).sin() * 2)
    assert metrics.get("trivial_graphs") == before
    assert kiln.metrics.get("graphs_executed") > 0
