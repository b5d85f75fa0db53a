"""Golden and numerical tests for the layout pass (kiln/passes/layout.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, capture, check_pass, f32

from kiln.config import config as kiln_config
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


def test_one_rule_can_be_switched_off_by_name():
    """``layout.NAME`` in ``disable_passes`` skips that rule only (for bench/pass_ab.py)."""
    g = capture(
        lambda x, w: (x.permute(1, 0, 2).reshape(6, 4).exp(), x[0].t().contiguous() @ w),
        torch.randn(2, 3, 4),
        torch.randn(3, 5),
    )
    before = kiln_config.disable_passes
    try:
        kiln_config.update(disable_passes="layout.reshape_of_copy")
        off = dce(layout(g))
    finally:
        kiln_config.update(disable_passes=before)
    on = dce(layout(g))
    assert off.count(lambda n: n.op == "reshape.default") == 0
    assert off.count(lambda n: n.op.startswith("clone")) == 1  # the permute's copy stays
    assert on.count(lambda n: n.op == "reshape.default") == 1
    for out in (off, on):  # the other rules still apply: the matmul reads without a copy
        mm = next(n for n in out.nodes if n.op == "mm.default")
        assert not out.nodes[mm.inputs[0]].op.startswith("clone")


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


def _heads_to_rows(a, b, c):
    # attention's q/k/v gradients: (B, H, T, D) -> (B, T, H*D), concatenated, then rows for a GEMM
    B, H, T, D = a.shape
    parts = [x.transpose(1, 2).reshape(B, T, H * D) for x in (a, b, c)]
    return torch.cat(parts, 2).reshape(B * T, 3 * H * D)


def test_cat_of_reshaped_permutes_reads_them_by_stride():
    g = capture(_heads_to_rows, *[torch.randn(2, 3, 5, 7) for _ in range(3)])
    out = check_pass(
        layout,
        g,
        """
        graph(%0: f32[2,3,5,7], %1: f32[2,3,5,7], %2: f32[2,3,5,7]) {
          %3 = permute.default(%0, [0, 2, 1, 3]) : f32[2,5,3,7]
          %4 = clone.default(%3, memory_format=torch.contiguous_format) : f32[2,5,3,7]
          %5 = reshape.default(%3, [2, 5, 21]) : f32[2,5,21]
          %6 = permute.default(%1, [0, 2, 1, 3]) : f32[2,5,3,7]
          %7 = clone.default(%6, memory_format=torch.contiguous_format) : f32[2,5,3,7]
          %8 = reshape.default(%6, [2, 5, 21]) : f32[2,5,21]
          %9 = permute.default(%2, [0, 2, 1, 3]) : f32[2,5,3,7]
          %10 = clone.default(%9, memory_format=torch.contiguous_format) : f32[2,5,3,7]
          %11 = reshape.default(%9, [2, 5, 21]) : f32[2,5,21]
          %12 = cat.default([%3, %6, %9], 2) : f32[2,5,9,7]
          %13 = view.default(%12, [2, 5, 63]) : f32[2,5,63]
          %14 = view.default(%13, [10, 63]) : f32[10,63]
          return (%14)
        }""",
    )
    # no copy is left but the cat: the reshapes and clones die
    assert dce(out).count(lambda n: n.op in ("clone.default", "reshape.default")) == 0


def test_cat_of_reshapes_along_a_merged_leading_dim():
    # cat along dim 0 of (B*T, C) rows made from (B, T, C) tensors: the cat goes along B
    g = capture(
        lambda a, b: torch.cat([a.transpose(0, 1).reshape(12, 5), b.reshape(12, 5)], 0).exp(),
        torch.randn(4, 3, 5),
        torch.randn(3, 4, 5),
    )
    out = dce(layout(g))
    cats = [n for n in out.nodes if n.op == "cat.default"]
    assert len(cats) == 1 and cats[0].args[1] == 0 and cats[0].type.shape == (6, 4, 5)
    check_pass(layout, g, str(layout(g)))


def test_cat_of_reshapes_that_merge_different_dims_stays():
    b = GraphBuilder()
    x = b.input(f32(2, 6))
    y = b.input(f32(3, 4))
    vx = call(b, "view.default", [V(x), (12,)], f32(12))
    vy = call(b, "view.default", [V(y), (12,)], f32(12))
    # sources of different shapes (both merge to 12): not the same dims, left as written
    c = call(b, "cat.default", [[V(vx), V(vy)], 0], f32(24))
    g = b.build([c])
    check_pass(layout, g, str(g))
    # a cat dim that splits a source dim (6 -> 2 x 3): no merged dims to concatenate along
    b = GraphBuilder()
    x = b.input(f32(2, 6))
    z = b.input(f32(2, 6))
    vx = call(b, "view.default", [V(x), (4, 3)], f32(4, 3))
    vz = call(b, "view.default", [V(z), (4, 3)], f32(4, 3))
    c = call(b, "cat.default", [[V(vx), V(vz)], 1], f32(4, 6))
    g = b.build([c])
    check_pass(layout, g, str(g))


def test_column_sum_of_a_reshape_sums_its_source():
    # a linear layer's bias gradient: sum over the rows of dy viewed as (B*T, C)
    g = capture(
        lambda a: (
            a.exp().reshape(-1, 7).sum(0),
            a.exp().reshape(-1, 7).sum(0, keepdim=True),
            a.exp().reshape(3, -1, 7).sum([0, 1]),
        ),
        torch.randn(2, 3, 7),
    )
    out = dce(layout(g))
    sums = [n for n in out.nodes if n.op == "sum.dim_IntList"]
    assert len(sums) == 3 and all(out.nodes[n.inputs[0]].op == "exp.default" for n in sums)
    assert all(n.args[1:] == ([0, 1], False) for n in sums)
    check_pass(layout, g, str(layout(g)))


def test_column_sum_of_a_reshape_that_moves_the_last_dim_stays():
    b = GraphBuilder()
    x = b.input(f32(2, 6))
    v = call(b, "view.default", [V(x), (4, 3)], f32(4, 3))
    s = call(b, "sum.dim_IntList", [V(v), (0,)], f32(3))
    y = b.input(f32(7))  # a rank-1 source: no leading dims to sum over
    w = call(b, "view.default", [V(y), (1, 7)], f32(1, 7))
    t = call(b, "sum.dim_IntList", [V(w), (0,)], f32(7))
    z = b.input(f32(0, 4, 5))  # zero rows: still the same sum (of nothing)
    u = call(b, "view.default", [V(z), (0, 5)], f32(0, 5))
    r = call(b, "sum.dim_IntList", [V(u), (0,)], f32(5))
    g = b.build([s, t, r])
    out = check_pass(layout, g, str(layout(g)))
    srcs = [out.nodes[n.inputs[0]].op for n in out.nodes if n.op == "sum.dim_IntList"]
    assert srcs == ["view.default", "view.default", "input"]


def test_a_dead_reader_does_not_keep_the_contiguous_copy():
    """AOTAutograd's backward of transformers' attention reshapes the contiguous copy of the
    attention gradient twice and uses one: the dead reshape is dropped first, and the copy goes."""
    b = GraphBuilder()
    x = b.input(f32(2, 3, 5, 7))
    w = b.input(f32(21, 4))
    e = call(b, "exp.default", [V(x)], f32(2, 3, 5, 7))
    p = call(b, "permute.default", [V(e), [0, 2, 1, 3]], f32(2, 5, 3, 7))
    c = call(b, "clone.default", [V(p)], f32(2, 5, 3, 7), memory_format=torch.contiguous_format)
    call(b, "view.default", [V(c), [2, 5, 21]], f32(2, 5, 21))  # dead
    v = call(b, "view.default", [V(c), [10, 21]], f32(10, 21))
    m = call(b, "mm.default", [V(v), V(w)], f32(10, 4))
    g = b.build([m])
    out = check_pass(
        layout,
        g,
        """
        graph(%0: f32[2,3,5,7], %1: f32[21,4]) {
          %2 = exp.default(%0) : f32[2,3,5,7]
          %3 = permute.default(%2, [0, 2, 1, 3]) : f32[2,5,3,7]
          %4 = clone.default(%3, memory_format=torch.contiguous_format) : f32[2,5,3,7]
          %5 = reshape.default(%3, [10, 21]) : f32[10,21]
          %6 = mm.default(%5, %1) : f32[10,4]
          return (%6)
        }""",
    )
    assert out.count(lambda n: n.op == "view.default") == 0


def _qkv_grads_to_rows(dq, kt, dk_t, dv):
    # attention's backward as AOTAutograd leaves it: dk^T = bmm(q^T, dS) is (B*H, E, T), read
    # permuted into the q/k/v gradient cat with E strided
    B, H, T, E = dq.shape
    dk = torch.bmm(kt, dk_t).view(B, H, E, T).permute(0, 3, 1, 2)
    parts = [dq.transpose(1, 2), dk, dv.transpose(1, 2)]
    return torch.cat(parts, 2).reshape(B * T, 3 * H * E)


def test_bmm_read_transposed_by_a_cat_computes_the_transpose():
    B, H, T, E = 2, 3, 5, 4
    args = (
        torch.randn(B, H, T, E),
        torch.randn(B * H, E, 6),
        torch.randn(B * H, 6, T),
        torch.randn(B, H, T, E),
    )
    g = capture(_qkv_grads_to_rows, *args)
    out = dce(layout(g))
    (mm,) = [n for n in out.nodes if n.op == "bmm.default"]
    assert mm.type.shape == (B * H, T, E)  # computed as (dS^T q), E innermost
    assert [out.nodes[i].op for i in mm.inputs] == ["permute.default"] * 2
    same = [n for n in out.nodes if n.op == "permute.default" and n.type.shape == (B, T, H, E)]
    assert len(same) == 3 and all(list(n.args[1]) == [0, 2, 1, 3] for n in same)
    check_pass(layout, g, str(layout(g)))  # verifies and computes the same values


def test_bmm_read_transposed_elsewhere_keeps_its_layout():
    def fn(a, b):
        y = torch.bmm(a, b).view(2, 3, 4, 5).permute(0, 3, 1, 2)
        return y.exp(), torch.cat([y, y], 2)  # an elementwise reader besides the cat

    g = capture(fn, torch.randn(6, 4, 7), torch.randn(6, 7, 5))
    check_pass(layout, g, str(g))
    g = capture(
        lambda a, b: torch.bmm(a, b).view(2, 3, 4, 5).permute(0, 3, 1, 2),
        *(torch.randn(6, 4, 7), torch.randn(6, 7, 5)),
    )
    check_pass(layout, g, str(g))  # a graph output: the caller gets eager's strides
