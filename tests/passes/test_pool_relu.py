"""The max-pool backward + ReLU backward pass (kiln/passes/pool_relu.py): when it rewrites, when it
must not, and the same values as the graph it replaces (reference interpreter)."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import V, call, f32

from kiln.codegen.interpreter import Interpreter
from kiln.ir import GraphBuilder, verify
from kiln.ir.graph import Graph, TensorType
from kiln.passes.pool_relu import OP, pool_relu

I64 = torch.int64
POOL_BWD = "max_pool2d_with_indices_backward.default"
WIN = ([3, 3], [2, 2], [1, 1], [1, 1], True)  # overlapping windows, padding, ceil_mode


def _graph(
    form: str = "where",
    zero: float = 0.0,
    le_of_self: bool = True,
    extra_reader: bool = False,
    threshold: float = 0,
) -> Graph:
    """``where(le(r, 0), zero, max_pool2d_with_indices_backward(g, r, ..., idx))`` for a
    ``[2,3,7,6]`` ReLU output ``r`` (inputs: g, r, idx, other)."""
    shape, out = (2, 3, 7, 6), (2, 3, 4, 4)
    b = GraphBuilder()
    g = b.input(f32(*out))
    r = b.input(f32(*shape))
    idx = b.input(TensorType(out, I64))
    other = b.input(f32(*shape))
    m = call(b, POOL_BWD, [V(g), V(r), *WIN, V(idx)], f32(*shape))
    if form == "where":
        c = call(b, "le.Scalar", [V(r if le_of_self else other), 0], TensorType(shape, torch.bool))
        z = b.constant(torch.tensor(zero))
        d = call(b, "where.self", [V(c), V(z), V(m)], f32(*shape))
    else:
        d = call(b, "threshold_backward.default", [V(m), V(r), threshold], f32(*shape))
    return verify(b.build([d, m] if extra_reader else [d]))


def _inputs(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, 6, generator=gen)
    x[0, 0, 0, :3] = float("nan")
    r = torch.relu(x)
    _, idx = torch.ops.aten.max_pool2d_with_indices(r, *WIN)
    return [torch.randn(2, 3, 4, 4, generator=gen), r, idx, torch.randn(2, 3, 7, 6, generator=gen)]


@pytest.mark.parametrize("form", ["where", "threshold_backward"])
def test_rewrites_to_one_node_with_the_same_values(form):
    g = _graph(form)
    out = verify(pool_relu(g))
    assert [n.op for n in out.nodes if n.op not in ("input", "constant")] == [OP]
    ins = _inputs()
    expected, got = Interpreter(g)(ins), Interpreter(out)(ins)
    torch.testing.assert_close(got[0], expected[0], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kw",
    [
        {"zero": -0.0},  # where(., -0.0, .) keeps the sign
        {"zero": 1.0},
        {"le_of_self": False},  # the mask of another tensor
        {"extra_reader": True},  # the pool backward is a graph output too
        {"form": "threshold_backward", "threshold": 0.5},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_leaves_other_forms_alone(kw):
    g = _graph(**kw)
    out = pool_relu(g)
    assert not any(n.op == OP for n in out.nodes)
    assert any(n.op == POOL_BWD for n in out.nodes)
