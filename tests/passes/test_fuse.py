"""Golden tests for fusion (kiln/passes/fuse.py)."""

from __future__ import annotations

from _fused_testlib import check_codegen_pass
from _passes_testlib import V, call, f32

from kiln.ir import GraphBuilder
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)


def chain():
    """add + relu -> mm -> exp, row sum -> div: the matmul splits two groups."""
    b = GraphBuilder()
    x, bias, w = b.input(f32(8, 16)), b.input(f32(16)), b.input(f32(16, 16))
    a = call(b, "add.Tensor", [V(x), V(bias)], f32(8, 16))
    r = call(b, "relu.default", [V(a)], f32(8, 16))
    m = call(b, "mm.default", [V(r), V(w)], f32(8, 16))
    e = call(b, "exp.default", [V(m)], f32(8, 16))
    s = call(b, "sum.dim_IntList", [V(e), [-1], True], f32(8, 1))
    d = call(b, "div.Tensor", [V(e), V(s)], f32(8, 16))
    return b.build([d])


def test_pointwise_chain_and_row_reduction():
    check_codegen_pass(
        fuse,
        chain(),
        """
        graph(%0: f32[8,16], %1: f32[16], %2: f32[16,16]) {
          %3 = fused(kind='pointwise', shape=[8, 16], body=[['add.Tensor', [%0, %1], [], 'f32'], ['relu.default', [Val(0)], [], 'f32']], outputs=[1], members=[3, 4]) : f32[8,16]
          %4 = mm.default(%3, %2) : f32[8,16]
          %5 = fused(kind='rows', shape=[8, 16], body=[['exp.default', [%4], [], 'f32'], ['sum.dim_IntList', [Val(0), [-1], True], [], 'f32'], ['div.Tensor', [Val(0), Val(1)], [], 'f32']], outputs=[1, 2], members=[6, 7, 8]) : f32[8,1], f32[8,16]
          %6 = getitem(%5, 0) : f32[8,1]
          %7 = getitem(%5, 1) : f32[8,16]
          return (%7)
        }""",  # noqa: E501
    )


def test_independent_updates_of_one_shape_fuse_horizontally():
    b = GraphBuilder()
    p1, g1, p2, g2 = (b.input(f32(4, 8)) for _ in range(4))
    u1 = call(b, "sub.Tensor", [V(p1), V(g1)], f32(4, 8), alpha=0.1)
    u2 = call(b, "sub.Tensor", [V(p2), V(g2)], f32(4, 8), alpha=0.1)
    check_codegen_pass(
        fuse,
        b.build([u1, u2]),
        """
        graph(%0: f32[4,8], %1: f32[4,8], %2: f32[4,8], %3: f32[4,8]) {
          %4 = fused(kind='pointwise', shape=[4, 8], body=[['sub.Tensor', [%0, %1], [['alpha', 0.1]], 'f32'], ['sub.Tensor', [%2, %3], [['alpha', 0.1]], 'f32']], outputs=[0, 1], members=[4, 5]) : f32[4,8], f32[4,8]
          %5 = getitem(%4, 0) : f32[4,8]
          %6 = getitem(%4, 1) : f32[4,8]
          return (%5, %6)
        }""",  # noqa: E501
    )


def test_lone_clone_is_left_to_aten():
    b = GraphBuilder()
    x = b.input(f32(4, 8))
    t = call(b, "permute.default", [V(x), [1, 0]], f32(8, 4))
    c = call(b, "clone.default", [V(t)], f32(8, 4))
    check_codegen_pass(
        fuse,
        b.build([c]),
        """
        graph(%0: f32[4,8]) {
          %1 = permute.default(%0, [1, 0]) : f32[8,4]
          %2 = clone.default(%1) : f32[8,4]
          return (%2)
        }""",
    )


def test_sum_over_every_dim_is_not_a_column_reduction():
    # nansum's decomposition sums with dim=None (every dim): neither a row nor a column kernel
    b = GraphBuilder()
    x = b.input(f32(3, 5))
    s = call(b, "sum.dim_IntList", [V(x), None], f32())
    check_codegen_pass(
        fuse,
        b.build([s]),
        """
        graph(%0: f32[3,5]) {
          %1 = sum.dim_IntList(%0, None) : f32[]
          return (%1)
        }""",
    )
