"""Golden and numerical tests for constant folding (kiln/passes/constant_fold.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, check_pass, f32

from kiln.codegen.interpreter import build
from kiln.ir import GraphBuilder, TensorType, verify
from kiln.passes.constant_fold import constant_fold
from kiln.passes.dce import dce


def _graph():
    b = GraphBuilder()
    x = b.input(f32(4))
    c = b.constant(torch.arange(4.0))
    d = call(b, "mul.Tensor", [V(c), 2.0], f32(4))
    e = call(b, "exp.default", [V(d)], f32(4))
    f = call(b, "add.Tensor", [V(x), V(e)], f32(4))  # reads a real input: stays
    big = b.constant(torch.ones(64, 64))
    bg = call(b, "neg.default", [V(big)], f32(64, 64))  # 4096 elements: too big to fold
    r = call(b, "rand_like.default", [V(c)], f32(4))  # random: never folded
    s = b.scalar("float")
    m = call(b, "mul.Tensor", [V(c), V(s)], f32(4))  # a lifted scalar is not a constant
    o = call(b, "neg.default", [V(c)], f32(4))  # a graph output: the caller could mutate it
    return b.build([f, bg, r, m, o])


def test_chains_of_constants_fold():
    g = _graph()
    out = check_pass(
        constant_fold,
        g,
        """
        graph(%0: f32[4], %8: float) {
          %1 = constant[0] : f32[4]
          %2 = constant[1] : f32[4]
          %3 = constant[2] : f32[4]
          %4 = add.Tensor(%0, %3) : f32[4]
          %5 = constant[3] : f32[64,64]
          %6 = neg.default(%5) : f32[64,64]
          %7 = rand_like.default(%1) : f32[4]
          %9 = mul.Tensor(%1, %8) : f32[4]
          %10 = neg.default(%1) : f32[4]
          return (%4, %6, %7, %9, %10)
        }""",
    )
    torch.testing.assert_close(out.constants[2], torch.exp(torch.arange(4.0) * 2.0))
    # After dce the intermediate constant is gone from the constant list too.
    cleaned = verify(dce(out))
    assert len(cleaned.constants) == 3


def test_folded_values_are_bit_identical_to_aten():
    b = GraphBuilder()
    c = b.constant(torch.linspace(-3, 3, 7))
    t = call(b, "tanh.default", [V(c)], f32(7))
    x = b.input(f32(7))
    y = call(b, "mul.Tensor", [V(x), V(t)], f32(7))
    out = verify(constant_fold(b.build([y])))
    assert torch.equal(out.constants[-1], torch.tanh(torch.linspace(-3, 3, 7)))


def test_factories_fold_but_empty_never_does():
    b = GraphBuilder()
    x = b.input(f32(3))
    z = call(b, "full.default", [(3,), 0.5], f32(3), dtype=torch.float32, pin_memory=False)
    e = call(b, "empty.memory_format", [(3,)], f32(3), dtype=torch.float32)
    y = call(b, "add.Tensor", [V(x), V(z)], f32(3))
    f = call(b, "fill.Scalar", [V(e), 1.0], f32(3))
    w = call(b, "mul.Tensor", [V(y), V(f)], f32(3))
    g = b.build([w])
    check_pass(
        constant_fold,
        g,
        """
        graph(%0: f32[3]) {
          %1 = constant[0] : f32[3]
          %2 = empty.memory_format([3], dtype=torch.float32) : f32[3]
          %3 = add.Tensor(%0, %1) : f32[3]
          %4 = fill.Scalar(%2, 1.0) : f32[3]
          %5 = mul.Tensor(%3, %4) : f32[3]
          return (%5)
        }""",
    )


def test_symbolic_shapes_and_failures_leave_nodes_alone():
    b = GraphBuilder()
    c = b.constant(torch.ones(2, 3))
    # A symbolic output shape: not folded.  A node whose types lie (so ATen disagrees): not folded.
    v = call(b, "view.default", [V(c), (6,)], TensorType(("s0",), torch.float32))
    bad = call(b, "mm.default", [V(c), V(c)], f32(2, 3))
    x = b.input(f32(6))
    y = call(b, "add.Tensor", [V(x), V(v)], f32(6))
    n = call(b, "neg.default", [V(bad)], f32(2, 3))
    g = b.build([y, n])
    out = verify(constant_fold(g))
    assert str(out) == str(g)


def test_an_output_with_users_folds_into_a_copy_of_the_constant():
    # The shape of a training forward's causal mask: a cumsum of a constant that backward reads
    # too (an output) and that the mask's chain reads here.  The output becomes a copy of the
    # folded value (never the stored constant itself), the chain reads the constant and folds.
    b = GraphBuilder()
    x = b.input(TensorType((4, 4), torch.bool))
    ones = b.constant(torch.ones(4, dtype=torch.int64))
    pos = call(b, "cumsum.default", [V(ones), -1], TensorType((4,), torch.int64))  # an output
    col = call(b, "unsqueeze.default", [V(pos), 1], TensorType((4, 1), torch.int64))
    mask = call(b, "le.Tensor", [V(pos), V(col)], TensorType((4, 4), torch.bool))
    y = call(b, "bitwise_and.Tensor", [V(x), V(mask)], TensorType((4, 4), torch.bool))
    view = call(b, "view.default", [V(ones), [2, 2]], TensorType((2, 2), torch.int64))  # no user
    g = b.build([y, pos, view])
    out = check_pass(
        constant_fold,
        g,
        """
        graph(%0: b8[4,4]) {
          %1 = constant[0] : i64[4]
          %2 = constant[1] : i64[4]
          %3 = clone.default(%2) : i64[4]
          %4 = constant[2] : i64[4,1]
          %5 = constant[3] : b8[4,4]
          %6 = bitwise_and.Tensor(%0, %5) : b8[4,4]
          %7 = view.default(%1, [2, 2]) : i64[2,2]
          return (%6, %3, %7)
        }""",
    )
    pos_want = torch.arange(1, 5)
    torch.testing.assert_close(out.constants[1], pos_want)
    torch.testing.assert_close(out.constants[3], pos_want <= pos_want.unsqueeze(1))
    # the copy is a fresh tensor each run: mutating one run's output leaves the next run's alone
    run, _ = build(out)
    mask_in = torch.ones(4, 4, dtype=torch.bool)
    first = run([mask_in])
    first[1].mul_(0)
    second = run([mask_in])
    torch.testing.assert_close(second[1], pos_want)
    torch.testing.assert_close(second[0], pos_want <= pos_want.unsqueeze(1))
