"""Golden and numerical tests for common-subexpression elimination (kiln/passes/cse.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, capture, check_pass, f32

from kiln.ir import GraphBuilder, TensorType
from kiln.passes.cse import cse


def test_duplicates_merge_transitively():
    g = capture(lambda x: (x.exp() + 1).sin() * (x.exp() + 1).sin(), torch.randn(4))
    check_pass(
        cse,
        g,
        """
        graph(%0: f32[4]) {
          %1 = exp.default(%0) : f32[4]
          %2 = add.Tensor(%1, 1) : f32[4]
          %3 = sin.default(%2) : f32[4]
          %4 = mul.Tensor(%3, %3) : f32[4]
          return (%4)
        }""",
    )


def test_literals_compare_exactly():
    # 0.0 and -0.0 (and 1 and 1.0) are different arguments.
    b = GraphBuilder()
    x = b.input(f32(4))
    a = call(b, "add.Tensor", [V(x), 0.0], f32(4))
    n = call(b, "add.Tensor", [V(x), -0.0], f32(4))
    i = b.input(TensorType((4,), torch.int64))
    p = call(b, "add.Tensor", [V(i), 1], TensorType((4,), torch.int64))
    q = call(b, "add.Tensor", [V(i), 1.0], f32(4))
    s = call(b, "mul.Tensor", [V(a), V(n)], f32(4))
    g = b.build([s, p, q])
    check_pass(cse, g, str(g))


def test_random_and_opaque_never_merge():
    b = GraphBuilder()
    x = b.input(f32(8))
    r1 = call(b, "rand_like.default", [V(x)], f32(8))
    r2 = call(b, "rand_like.default", [V(x)], f32(8))
    o1 = call(b, "opaque.aten::nonzero.default", [V(x)], TensorType(("u0", 1), torch.int64))
    o2 = call(b, "opaque.aten::nonzero.default", [V(x)], TensorType(("u1", 1), torch.int64))
    s = call(b, "sub.Tensor", [V(r1), V(r2)], f32(8))
    g = b.build([s, o1, o2])
    out = check_pass(cse, g, str(g))
    assert out.count(lambda n: n.op == "rand_like.default") == 2


def test_equal_constants_merge():
    b = GraphBuilder()
    x = b.input(f32(3))
    c1 = b.constant(torch.tensor([1.0, 2.0, 3.0]))
    c2 = b.constant(torch.tensor([1.0, 2.0, 3.0]))
    c3 = b.constant(torch.tensor([1.0, 2.0, 4.0]))
    a = call(b, "add.Tensor", [V(x), V(c1)], f32(3))
    m = call(b, "mul.Tensor", [V(a), V(c2)], f32(3))
    d = call(b, "div.Tensor", [V(m), V(c3)], f32(3))
    g = b.build([d])
    out = check_pass(
        cse,
        g,
        """
        graph(%0: f32[3]) {
          %1 = constant[0] : f32[3]
          %2 = constant[1] : f32[3]
          %3 = add.Tensor(%0, %1) : f32[3]
          %4 = mul.Tensor(%3, %1) : f32[3]
          %5 = div.Tensor(%4, %2) : f32[3]
          return (%5)
        }""",
    )
    assert len(out.constants) == 2


def test_two_outputs_stay_two_tensors():
    # Eager returns two distinct tensors; the caller may mutate one of them.
    g = capture(lambda x: (x.exp(), x.exp(), x.view(2, 2), x.view(2, 2)), torch.randn(4))
    check_pass(
        cse,
        g,
        """
        graph(%0: f32[4]) {
          %1 = exp.default(%0) : f32[4]
          %2 = exp.default(%0) : f32[4]
          %3 = view.default(%0, [2, 2]) : f32[2,2]
          return (%1, %2, %3, %3)
        }""",
    )
