"""Bytes a graph holds while each node runs (kiln/passes/live_bytes.py): golden profiles of small
graphs, views keeping their buffer alive, outputs living to the end, the two models of graph
inputs, symbolic sizes, and the headroom a pass may fill without raising the peak."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, f32

from kiln.ir.graph import GraphBuilder, TensorType
from kiln.passes.live_bytes import headroom, live_bytes

KB = 1024  # bytes of a float32 [16, 16]


def _chain():
    """x -> a = relu(x) -> v = view(a) -> c = exp(v) -> d = sum(c)   (d is the output)."""
    b = GraphBuilder()
    x = b.input(f32(16, 16))
    a = call(b, "relu.default", [V(x)], f32(16, 16))
    v = call(b, "view.default", [V(a), [256]], f32(256))
    c = call(b, "exp.default", [V(v)], f32(256))
    d = call(b, "sum.default", [V(c)], f32())
    return b.build([d])


def test_golden_profile():
    g = _chain()
    # nodes: x, a, v, c, d.  Held inputs: x lives throughout; a lives until c reads its view;
    # c until d; d (the output) to the end
    assert live_bytes(g, inputs_held=True) == [KB, 2 * KB, 2 * KB, 3 * KB, 2 * KB + 4]
    # dropped after their last use: x dies at a (node 1)
    assert live_bytes(g, inputs_held=False) == [KB, 2 * KB, KB, 2 * KB, KB + 4]


def test_headroom_under_both_models():
    room = headroom(_chain())
    # peaks: 3 KB (held) and 2 KB (dropped); the room is the smaller of the two at each node
    assert room == [KB, 0, KB, 0, KB - 4]


def test_symbolic_sizes_give_none():
    b = GraphBuilder()
    n = b.scalar("s0")
    x = b.input(TensorType(("s0", 16), torch.float32))
    y = call(b, "relu.default", [V(x)], TensorType(("s0", 16), torch.float32))
    g = b.build([y, n])
    assert live_bytes(g, inputs_held=True) is None
    assert headroom(g) is None
