"""Golden and numerical tests for dead-code elimination (kiln/passes/dce.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, check_pass, f32

from kiln.ir import GraphBuilder, TensorType
from kiln.passes.dce import dce


def test_dead_nodes_and_constants_go_inputs_stay():
    b = GraphBuilder()
    x = b.input(f32(4))
    unused_in = b.input(f32(2))
    c = b.constant(torch.ones(4))
    dead = call(b, "exp.default", [V(x)], f32(4))
    call(b, "mul.Tensor", [V(dead), V(c)], f32(4))
    k = b.constant(torch.full((4,), 2.0))
    y = call(b, "add.Tensor", [V(x), V(k)], f32(4))
    g = b.build([y])
    assert unused_in == 1
    out = check_pass(
        dce,
        g,
        """
        graph(%0: f32[4], %1: f32[2]) {
          %2 = constant[0] : f32[4]
          %3 = add.Tensor(%0, %2) : f32[4]
          return (%3)
        }""",
    )
    assert len(out.constants) == 1 and torch.equal(out.constants[0], torch.full((4,), 2.0))


def test_side_effects_and_random_draws_are_kept():
    b = GraphBuilder()
    x = b.input(f32(8))
    call(b, "opaque.aten::mul_.Tensor", [V(x), 2.0], f32(8))  # mutates x: result unused
    d = call(b, "native_dropout.default", [V(x), 0.5, True], [f32(8), TensorType((8,), torch.bool)])
    b.getitem(d, 1)  # unused mask
    call(b, "rand_like.default", [V(x)], f32(8))  # unused draw
    y = call(b, "neg.default", [V(x)], f32(8))
    g = b.build([y])
    check_pass(
        dce,
        g,
        """
        graph(%0: f32[8]) {
          %1 = opaque.aten::mul_.Tensor(%0, 2.0) : f32[8]
          %2 = native_dropout.default(%0, 0.5, True) : f32[8], b8[8]
          %3 = rand_like.default(%0) : f32[8]
          %4 = neg.default(%0) : f32[8]
          return (%4)
        }""",
    )


def test_multi_output_node_kept_for_one_used_element():
    b = GraphBuilder()
    x = b.input(f32(2, 4))
    w = b.input(f32(4))
    bias = b.input(f32(4))
    ln = call(
        b,
        "native_layer_norm.default",
        [V(x), (4,), V(w), V(bias), 1e-5],
        [f32(2, 4), f32(2, 1), f32(2, 1)],
    )
    y = b.getitem(ln, 0)
    b.getitem(ln, 1)
    b.getitem(ln, 2)
    g = b.build([y])
    check_pass(
        dce,
        g,
        """
        graph(%0: f32[2,4], %1: f32[4], %2: f32[4]) {
          %3 = native_layer_norm.default(%0, [4], %1, %2, 1e-05) : f32[2,4], f32[2,1], f32[2,1]
          %4 = getitem(%3, 0) : f32[2,4]
          return (%4)
        }""",
    )


def test_nothing_dead_returns_the_same_graph():
    b = GraphBuilder()
    x = b.input(f32(3))
    g = b.build([call(b, "sin.default", [V(x)], f32(3))])
    assert dce(g) is g
