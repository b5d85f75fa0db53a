"""The ReLU + max pool pass (kiln/passes/relu_pool.py): when it rewrites, when it must not, and the
same values as the graph it replaces (reference interpreter)."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import V, call, f32

from kiln.codegen.interpreter import Interpreter
from kiln.ir import GraphBuilder, verify
from kiln.ir.graph import Graph, TensorType
from kiln.passes.relu_pool import OP, relu_pool

I64 = torch.int64
POOL = "max_pool2d_with_indices.default"


def _graph(act: str = "relu.default", relu_output: bool = True, two_pools: bool = False) -> Graph:
    """``max_pool2d_with_indices(relu(x * 2), [3, 3], [2, 2], [1, 1])`` of a ``[2,3,7,6]`` input;
    outputs: the pooled values and indices (and the ReLU's output, and a second pool's values)."""
    shape, out = (2, 3, 7, 6), (2, 3, 4, 3)
    b = GraphBuilder()
    x = b.input(f32(*shape))
    m = call(b, "mul.Tensor", [V(x), 2.0], f32(*shape))
    r = call(b, act, [V(m)], f32(*shape))
    p = call(b, POOL, [V(r), [3, 3], [2, 2], [1, 1]], (f32(*out), TensorType(out, I64)))
    outs = [b.getitem(p, 0), b.getitem(p, 1)]
    if two_pools:
        q = call(b, POOL, [V(r), [2, 2]], (f32(2, 3, 3, 3), TensorType((2, 3, 3, 3), I64)))
        outs.append(b.getitem(q, 0))
    if relu_output:
        outs.append(r)
    return verify(b.build(outs))


def _check_values(g: Graph, out: Graph) -> None:
    x = torch.randn(2, 3, 7, 6)
    x[0, 0, :2, :2] = float("nan")
    expected, got = Interpreter(g)([x]), Interpreter(out)([x])
    assert len(expected) == len(got)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("kw", [{}, {"relu_output": False}, {"two_pools": True}], ids=str)
def test_rewrites_to_one_node_with_the_same_values(kw):
    g = _graph(**kw)
    out = verify(relu_pool(g))
    ops = [n.op for n in out.nodes]
    assert ops.count(OP) == 1 and "relu.default" not in ops
    assert ops.count(POOL) == (1 if kw.get("two_pools") else 0)  # the second pool reads the ReLU
    _check_values(g, out)


def test_leaves_other_forms_alone():
    g = _graph(act="sigmoid.default")
    assert relu_pool(g) is g
    b = GraphBuilder()  # the pool's tuple is a graph output: no getitem to redirect
    x = b.input(f32(1, 2, 4, 4))
    r = call(b, "relu.default", [V(x)], f32(1, 2, 4, 4))
    p = call(b, POOL, [V(r), [2, 2]], (f32(1, 2, 2, 2), TensorType((1, 2, 2, 2), I64)))
    g = b.build([p])
    assert relu_pool(g) is g
