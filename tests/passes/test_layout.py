"""Golden and numerical tests for the layout pass (kiln/passes/layout.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, capture, check_pass, f32

from kiln.ir import GraphBuilder
from kiln.passes.dce import dce
from kiln.passes.layout import layout


def test_contiguous_copies_feeding_a_matmul_are_bypassed():
    g = capture(
        lambda x, w: (x.t().contiguous() @ w.t(), (x.t() @ w.t().contiguous()).reshape(-1)),
        torch.randn(8, 4),
        torch.randn(16, 8),
    )
    out = check_pass(
        layout,
        g,
        """
        graph(%0: f32[8,4], %1: f32[16,8]) {
          %2 = permute.default(%0, [1, 0]) : f32[4,8]
          %3 = clone.default(%2, memory_format=torch.contiguous_format) : f32[4,8]
          %4 = permute.default(%1, [1, 0]) : f32[8,16]
          %5 = mm.default(%2, %4) : f32[4,16]
          %6 = permute.default(%0, [1, 0]) : f32[4,8]
          %7 = permute.default(%1, [1, 0]) : f32[8,16]
          %8 = clone.default(%7, memory_format=torch.contiguous_format) : f32[8,16]
          %9 = mm.default(%6, %7) : f32[4,16]
          %10 = view.default(%9, [-1]) : f32[64]
          return (%5, %10)
        }""",
    )
    assert dce(out).count(lambda n: n.op.startswith("clone")) == 0


def test_reshape_of_a_contiguous_copy_becomes_reshape():
    g = capture(
        lambda x: (
            x.permute(1, 0, 2).reshape(6, 4).exp(),
            torch.bmm(x, x.transpose(1, 2).contiguous()),
        ),
        torch.randn(2, 3, 4),
    )
    check_pass(
        layout,
        g,
        """
        graph(%0: f32[2,3,4]) {
          %1 = permute.default(%0, [1, 0, 2]) : f32[3,2,4]
          %2 = clone.default(%1, memory_format=torch.contiguous_format) : f32[3,2,4]
          %3 = reshape.default(%1, [6, 4]) : f32[6,4]
          %4 = exp.default(%3) : f32[6,4]
          %5 = permute.default(%0, [0, 2, 1]) : f32[2,4,3]
          %6 = clone.default(%5, memory_format=torch.contiguous_format) : f32[2,4,3]
          %7 = bmm.default(%0, %5) : f32[2,3,3]
          return (%4, %7)
        }""",
    )


def test_reshape_returned_to_the_caller_keeps_its_copy():
    # As an output, reshape(permute(x)) could alias the caller's x; the fresh copy must stay.
    g = capture(lambda x: x.permute(1, 0, 2).reshape(6, 4), torch.randn(2, 3, 4))
    check_pass(layout, g, str(g))


def test_unsafe_view_is_spelled_view():
    b = GraphBuilder()
    x = b.input(f32(4, 6))
    w = b.input(f32(6, 2))
    m = call(b, "mm.default", [V(x), V(w)], f32(4, 2))
    u = call(b, "_unsafe_view.default", [V(m), (8,)], f32(8))
    g = b.build([u])
    check_pass(
        layout,
        g,
        """
        graph(%0: f32[4,6], %1: f32[6,2]) {
          %2 = mm.default(%0, %1) : f32[4,2]
          %3 = view.default(%2, [8]) : f32[8]
          return (%3)
        }""",
    )


def test_copy_with_a_second_reader_is_not_duplicated():
    # The copy also feeds exp: turning the view into reshape(permute) might copy twice.
    b = GraphBuilder()
    x = b.input(f32(2, 3))
    p = call(b, "permute.default", [V(x), (1, 0)], f32(3, 2))
    c = call(b, "clone.default", [V(p)], f32(3, 2), memory_format=torch.contiguous_format)
    v = call(b, "view.default", [V(c), (6,)], f32(6))
    e = call(b, "exp.default", [V(c)], f32(3, 2))
    s = call(b, "sum.default", [V(v)], f32())
    g = b.build([s, e])
    check_pass(layout, g, str(g))
