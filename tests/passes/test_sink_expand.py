"""Golden and numerical tests for the expand-sinking pass (kiln/passes/sink_expand.py)."""

from __future__ import annotations

from _passes_testlib import V, call, check_pass, f32

from kiln.ir import GraphBuilder
from kiln.passes.sink_expand import sink_expand


def _rms_backward_tail(output_is_div: bool = False):
    """The decomposed RMS norm backward's ``div(expand(term), D) * (2 * x) + a`` (odd sizes)."""
    b = GraphBuilder()
    term = b.input(f32(3, 5, 1))
    x = b.input(f32(3, 5, 7))
    a = b.input(f32(3, 5, 7))
    e = call(b, "expand.default", [V(term), [3, 5, 7]], f32(3, 5, 7))
    d = call(b, "div.Scalar", [V(e), 7], f32(3, 5, 7))
    x2 = call(b, "mul.Scalar", [V(x), 2.0], f32(3, 5, 7))
    m = call(b, "mul.Tensor", [V(d), V(x2)], f32(3, 5, 7))
    out = call(b, "add.Tensor", [V(a), V(m)], f32(3, 5, 7))
    return b.build([out, d] if output_is_div else [out])


def test_expand_moves_below_a_unary_op_and_is_read_through():
    check_pass(
        sink_expand,
        _rms_backward_tail(),
        """
        graph(%0: f32[3,5,1], %1: f32[3,5,7], %2: f32[3,5,7]) {
          %3 = div.Scalar(%0, 7) : f32[3,5,1]
          %4 = mul.Scalar(%1, 2.0) : f32[3,5,7]
          %5 = mul.Tensor(%3, %4) : f32[3,5,7]
          %6 = add.Tensor(%2, %5) : f32[3,5,7]
          return (%6)
        }""",
    )


def test_graph_outputs_keep_their_shape():
    g = _rms_backward_tail(output_is_div=True)
    out = sink_expand(g)
    assert out is g  # the div is an output: its shape stays; the mul reads the div as it is


def test_expand_that_adds_dims_is_left_alone():
    b = GraphBuilder()
    v = b.input(f32(5, 1))
    x = b.input(f32(3, 5, 7))
    e = call(b, "expand.default", [V(v), [3, 5, 7]], f32(3, 5, 7))
    m = call(b, "mul.Tensor", [V(e), V(x)], f32(3, 5, 7))
    g = b.build([m])
    assert sink_expand(g) is g
