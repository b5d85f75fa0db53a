"""Golden tests for the decisions of fusion (kiln/passes/fuse.py): which reductions are row or
column kernels, what joins a group (and what may not: cycles, full groups, the horizontal window),
which inputs are read through their strides, and which one-element constants become literals.

Each case compares the exact graph after ``fuse`` and, where the kernels are small, the C++
backend's results against the reference interpreter on the graph before fusion."""

from __future__ import annotations

import pytest
import torch
from _fused_testlib import check_codegen_pass
from _passes_testlib import V, call, f32

from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.ir import Graph, GraphBuilder, In, Node, TensorType, verify
from kiln.ir.kernel import FusedKernel
from kiln.passes.fuse import HORIZONTAL_WINDOW, MAX_GROUP, MAX_HORIZONTAL


def test_row_reductions_over_the_last_dim_written_as_a_positive_index():
    b = GraphBuilder()
    x = b.input(f32(8, 16))
    s = call(b, "sum.dim_IntList", [V(x), [1], True], f32(8, 1))
    sm = call(b, "_softmax.default", [V(x), -1, False], f32(8, 16))
    ls = call(b, "_log_softmax.default", [V(x), 1, False], f32(8, 16))
    first = call(b, "_softmax.default", [V(x), 0, False], f32(8, 16))  # not the last dim: ATen
    check_codegen_pass(
        fuse,
        b.build([s, sm, ls, first]),
        """
        graph(%0: f32[8,16]) {
          %1 = fused(kind='rows', shape=[8, 16], body=[['sum.dim_IntList', [%0, [1], True], [], 'f32']], outputs=[0], members=[1]) : f32[8,1]
          %2 = fused(kind='rows', shape=[8, 16], body=[['_softmax.default', [%0, -1, False], [], 'f32']], outputs=[0], members=[2]) : f32[8,16]
          %3 = fused(kind='rows', shape=[8, 16], body=[['_log_softmax.default', [%0, 1, False], [], 'f32']], outputs=[0], members=[3]) : f32[8,16]
          %4 = _softmax.default(%0, 0, False) : f32[8,16]
          return (%1, %2, %3, %4)
        }""",  # noqa: E501
    )


def test_column_reductions_over_every_leading_dim():
    b = GraphBuilder()
    x, y = b.input(f32(8, 16)), b.input(f32(2, 4, 8))
    e = call(b, "exp.default", [V(x)], f32(8, 16))
    c = call(b, "sum.dim_IntList", [V(e), [0]], f32(16))
    c3 = call(b, "sum.dim_IntList", [V(y), [-2, 0]], f32(8))  # any order, negative dims
    part = call(b, "sum.dim_IntList", [V(y), [0]], f32(4, 8))  # not every leading dim
    typed = call(b, "sum.dim_IntList", [V(x), [0]], f32(16), dtype=torch.float32)
    check_codegen_pass(
        fuse,
        b.build([c, c3, part, typed]),
        """
        graph(%0: f32[8,16], %1: f32[2,4,8]) {
          %2 = fused(kind='cols', shape=[8, 16], body=[['exp.default', [%0], [], 'f32'], ['sum.dim_IntList', [Val(0), [0]], [], 'f32']], outputs=[1], members=[2, 3]) : f32[16]
          %3 = fused(kind='cols', shape=[2, 4, 8], body=[['sum.dim_IntList', [%1, [-2, 0]], [], 'f32']], outputs=[0], members=[4]) : f32[8]
          %4 = sum.dim_IntList(%1, [0]) : f32[4,8]
          %5 = sum.dim_IntList(%0, [0], dtype=torch.float32) : f32[16]
          return (%2, %3, %4, %5)
        }""",  # noqa: E501
    )


def test_scalar_inputs_and_one_element_constants_are_fused():
    # a ``scalar`` graph input is read by the kernel; one-element ``full`` / ``scalar_tensor``
    # constants become literals holding the value their dtype stores (0.1 in f16 and bf16)
    b = GraphBuilder()
    x = b.input(f32(4, 8))
    s = b.scalar("float")
    two = call(b, "full.default", [[1, 1], 2.0], f32(1, 1), dtype=torch.float32)
    h = call(b, "full.default", [[], 0.1], TensorType((), torch.float16), dtype=torch.float16)
    bf = call(
        b, "scalar_tensor.default", [0.1], TensorType((), torch.bfloat16), dtype=torch.bfloat16
    )
    wide = call(b, "full.default", [[4, 8], 0.5], f32(4, 8), dtype=torch.float32)
    m = call(b, "mul.Tensor", [V(x), V(s)], f32(4, 8))
    a = call(b, "add.Tensor", [V(m), V(two)], f32(4, 8))
    a = call(b, "mul.Tensor", [V(a), V(h)], f32(4, 8))
    a = call(b, "sub.Tensor", [V(a), V(bf)], f32(4, 8))
    a = call(b, "add.Tensor", [V(a), V(wide)], f32(4, 8))
    check_codegen_pass(
        fuse,
        b.build([a, two]),
        """
        graph(%0: f32[4,8], %1: float) {
          %2 = full.default([1, 1], 2.0, dtype=torch.float32) : f32[1,1]
          %3 = full.default([4, 8], 0.5, dtype=torch.float32) : f32[4,8]
          %4 = fused(kind='pointwise', shape=[4, 8], body=[['mul.Tensor', [%0, %1], [], 'f32'], ['add.Tensor', [Val(0), Lit(2.0,f32)], [], 'f32'], ['mul.Tensor', [Val(1), Lit(0.0999755859375,f16)], [], 'f32'], ['sub.Tensor', [Val(2), Lit(0.10009765625,bf16)], [], 'f32'], ['add.Tensor', [Val(3), %3], [], 'f32']], outputs=[4], members=[6, 7, 8, 9, 10]) : f32[4,8]
          return (%4, %2)
        }""",  # noqa: E501
    )


def test_inputs_read_through_a_layout_view_are_marked_strided():
    # %3 is a transpose (read through its strides); %4, a matmul of it, is a fresh buffer
    b = GraphBuilder()
    x, w, y = b.input(f32(4, 8)), b.input(f32(8, 8)), b.input(f32(8, 4))
    t = call(b, "t.default", [V(y)], f32(4, 8))
    mt = call(b, "mm.default", [V(t), V(w)], f32(4, 8))
    a = call(b, "add.Tensor", [V(t), V(mt)], f32(4, 8))
    a = call(b, "add.Tensor", [V(a), V(x)], f32(4, 8))
    check_codegen_pass(
        fuse,
        b.build([a]),
        """
        graph(%0: f32[4,8], %1: f32[8,8], %2: f32[8,4]) {
          %3 = t.default(%2) : f32[4,8]
          %4 = mm.default(%3, %1) : f32[4,8]
          %5 = fused(kind='pointwise', shape=[4, 8], body=[['add.Tensor', [%3, %4], [], 'f32'], ['add.Tensor', [Val(0), %0], [], 'f32']], outputs=[1], members=[5, 6], strided=[0]) : f32[4,8]
          return (%5)
        }""",  # noqa: E501
    )


_COPIES = {
    "clone.default": ((), ()),
    "alias.default": ((), ()),
    "_to_copy.default": ((), (("dtype", torch.float32),)),
    "copy.default": ((1,), ()),  # copy(dst, src): reads the second input
}


@pytest.mark.parametrize("op", list(_COPIES))
def test_a_lone_copy_is_left_to_aten_but_fuses_with_real_work(op):
    extra, kwargs = _COPIES[op]
    b = GraphBuilder()
    x, y = b.input(f32(4, 8)), b.input(f32(4, 8))
    args = [V(x)] + [V(y) for _ in extra]
    c = call(b, op, args, f32(4, 8), **dict(kwargs))
    text = ", ".join(["%0"] + ["%1" for _ in extra] + [f"{k}={v}" for k, v in kwargs])
    check_codegen_pass(
        fuse,
        b.build([c]),
        f"""
        graph(%0: f32[4,8], %1: f32[4,8]) {{
          %2 = {op}({text}) : f32[4,8]
          return (%2)
        }}""",
    )
    # the same copy followed by a relu: one kernel
    b = GraphBuilder()
    x, y = b.input(f32(4, 8)), b.input(f32(4, 8))
    c = call(b, op, [V(x)] + [V(y) for _ in extra], f32(4, 8), **dict(kwargs))
    r = call(b, "relu.default", [V(c)], f32(4, 8))
    out = verify(fuse(b.build([r])))
    assert [FusedKernel.of(n).members for n in out.nodes if n.op == "fused"] == [(c, r)]


def _diamond() -> Graph:
    """A node whose other input depends on its candidate group T only along one of several paths
    through other groups: T = exp(x) [16,16], C = relu(y) [16,8], D = neg(C @ w1) [16,4] (depends
    on C), then a2 = T @ (D @ w2) depends on T, C and D.  ``add(T, a2)`` must not join T."""
    b = GraphBuilder()
    x, y = b.input(f32(16, 16)), b.input(f32(16, 8))
    w1, w2 = b.input(f32(8, 4)), b.input(f32(4, 16))
    t = call(b, "exp.default", [V(x)], f32(16, 16))
    c = call(b, "relu.default", [V(y)], f32(16, 8))
    cm = call(b, "mm.default", [V(c), V(w1)], f32(16, 4))
    d = call(b, "neg.default", [V(cm)], f32(16, 4))
    a = call(b, "mm.default", [V(d), V(w2)], f32(16, 16))
    a2 = call(b, "mm.default", [V(t), V(a)], f32(16, 16))
    n = call(b, "add.Tensor", [V(t), V(a2)], f32(16, 16))
    return b.build([n])


def test_no_group_joins_a_group_its_other_input_depends_on_through_other_groups():
    check_codegen_pass(
        fuse,
        _diamond(),
        """
        graph(%0: f32[16,16], %1: f32[16,8], %2: f32[8,4], %3: f32[4,16]) {
          %4 = fused(kind='pointwise', shape=[16, 16], body=[['exp.default', [%0], [], 'f32']], outputs=[0], members=[4]) : f32[16,16]
          %5 = fused(kind='pointwise', shape=[16, 8], body=[['relu.default', [%1], [], 'f32']], outputs=[0], members=[5]) : f32[16,8]
          %6 = mm.default(%5, %2) : f32[16,4]
          %7 = fused(kind='pointwise', shape=[16, 4], body=[['neg.default', [%6], [], 'f32']], outputs=[0], members=[7]) : f32[16,4]
          %8 = mm.default(%7, %3) : f32[16,16]
          %9 = mm.default(%4, %8) : f32[16,16]
          %10 = fused(kind='pointwise', shape=[16, 16], body=[['add.Tensor', [%4, %9], [], 'f32']], outputs=[0], members=[10]) : f32[16,16]
          return (%10)
        }""",  # noqa: E501
    )


def _kernels(g: Graph) -> list[tuple[str, int, int, int]]:
    """(kind, member count, first member, last member) of each fused node, in order."""
    res = []
    for n in g.nodes:
        if n.op == "fused":
            k = FusedKernel.of(n)
            res.append((str(k.kind), len(k.members), k.members[0], k.members[-1]))
    return res


def test_group_size_limit_and_horizontal_window():
    # A = exp(x); a chain of 5 * MAX_GROUP negs behind a matmul of A fills five groups exactly;
    # the row sum at its end finds the last group full and starts its own; relu(z), independent
    # of everything, passes the five full groups (all inside the window) and joins A, the sixth.
    assert (MAX_GROUP, HORIZONTAL_WINDOW) == (256, 6)  # the defaults this graph is sized for
    b = GraphBuilder()
    x, z, w = b.input(f32(4, 8)), b.input(f32(4, 8)), b.input(f32(8, 8))
    a = call(b, "exp.default", [V(x)], f32(4, 8))
    v = call(b, "mm.default", [V(a), V(w)], f32(4, 8))
    first = v + 1
    for _ in range(5 * MAX_GROUP):
        v = call(b, "neg.default", [V(v)], f32(4, 8))
    s = call(b, "sum.dim_IntList", [V(v), [-1], True], f32(4, 1))
    r = call(b, "relu.default", [V(z)], f32(4, 8))
    out = verify(fuse(b.build([s, r])))
    chains = [
        ("pointwise", MAX_GROUP, first + k * MAX_GROUP, first + (k + 1) * MAX_GROUP - 1)
        for k in range(5)
    ]
    assert _kernels(out) == [("pointwise", 2, a, r), *chains, ("rows", 1, s, s)]


def test_a_node_beyond_the_horizontal_window_starts_its_own_group():
    # as above with six full groups: A is now the seventh most recent, outside the window
    b = GraphBuilder()
    x, z, w = b.input(f32(4, 8)), b.input(f32(4, 8)), b.input(f32(8, 8))
    a = call(b, "exp.default", [V(x)], f32(4, 8))
    v = call(b, "mm.default", [V(a), V(w)], f32(4, 8))
    for _ in range(6 * MAX_GROUP):
        v = call(b, "neg.default", [V(v)], f32(4, 8))
    r = call(b, "relu.default", [V(z)], f32(4, 8))
    out = verify(fuse(b.build([v, r])))
    kernels = _kernels(out)
    assert kernels[0] == ("pointwise", 1, a, a) and kernels[-1] == ("pointwise", 1, r, r)
    assert [k[1] for k in kernels[1:-1]] == [MAX_GROUP] * 6


def test_independent_nodes_fuse_horizontally_at_most_max_horizontal_per_kernel():
    # 100 independent updates of one shape (an optimizer's per-parameter updates, each with its
    # own input and output arrays): kernels of MAX_HORIZONTAL members, not one of 100, which g++
    # takes superlinearly long to build; a chain still grows past it (the test above).
    assert MAX_HORIZONTAL == 32
    b = GraphBuilder()
    outs = [call(b, "relu.default", [V(b.input(f32(4, 8)))], f32(4, 8)) for _ in range(100)]
    out = verify(fuse(b.build(outs)))
    assert [k[1] for k in _kernels(out)] == [32, 32, 32, 4]


def test_reductions_that_are_neither_row_nor_column_kernels_stay():
    # amax over every dim (no dim argument), a row sum with a dtype, mean / amax over the leading
    # dim (only a sum is a column kernel); a mean over the last dim of a rank-3 tensor is a row one
    b = GraphBuilder()
    x, y = b.input(f32(8, 16)), b.input(f32(2, 4, 8))
    a = call(b, "amax.default", [V(x)], f32())
    sd = call(b, "sum.dim_IntList", [V(x), [-1], True], f32(8, 1), dtype=torch.float32)
    mn = call(b, "mean.dim", [V(x), [0]], f32(16))
    am = call(b, "amax.default", [V(x), [0]], f32(16))
    m3 = call(b, "mean.dim", [V(y), [2]], f32(2, 4))
    check_codegen_pass(
        fuse,
        b.build([a, sd, mn, am, m3]),
        """
        graph(%0: f32[8,16], %1: f32[2,4,8]) {
          %2 = amax.default(%0) : f32[]
          %3 = sum.dim_IntList(%0, [-1], True, dtype=torch.float32) : f32[8,1]
          %4 = mean.dim(%0, [0]) : f32[16]
          %5 = amax.default(%0, [0]) : f32[16]
          %6 = fused(kind='rows', shape=[2, 4, 8], body=[['mean.dim', [%1, [2]], [], 'f32']], outputs=[0], members=[6]) : f32[2,4]
          return (%2, %3, %4, %5, %6)
        }""",  # noqa: E501
    )


def test_an_input_reached_through_views_of_a_transpose_is_strided():
    b = GraphBuilder()
    x, y = b.input(f32(1, 4, 8)), b.input(f32(8, 4))
    t = call(b, "t.default", [V(y)], f32(4, 8))
    u = call(b, "unsqueeze.default", [V(t), 0], f32(1, 4, 8))
    z = call(b, "add.Tensor", [V(u), V(x)], f32(1, 4, 8))
    z = call(b, "relu.default", [V(z)], f32(1, 4, 8))
    check_codegen_pass(
        fuse,
        b.build([z]),
        """
        graph(%0: f32[1,4,8], %1: f32[8,4]) {
          %2 = t.default(%1) : f32[4,8]
          %3 = unsqueeze.default(%2, 0) : f32[1,4,8]
          %4 = fused(kind='pointwise', shape=[1, 4, 8], body=[['add.Tensor', [%3, %0], [], 'f32'], ['relu.default', [Val(0)], [], 'f32']], outputs=[1], members=[4, 5], strided=[0]) : f32[1,4,8]
          return (%4)
        }""",  # noqa: E501
    )


def test_every_input_after_a_scalar_is_checked():
    # pow(s, e): the scalar s is fine, the int32 exponent is not a type the backend claims
    b = GraphBuilder()
    s = b.scalar("float")
    e32, e = b.input(TensorType((4, 8), torch.int32)), b.input(f32(4, 8))
    p32 = call(b, "pow.Scalar", [V(s), V(e32)], f32(4, 8))
    p = call(b, "pow.Scalar", [V(s), V(e)], f32(4, 8))
    check_codegen_pass(
        fuse,
        b.build([p32, p]),
        """
        graph(%0: float, %1: i32[4,8], %2: f32[4,8]) {
          %3 = pow.Scalar(%0, %1) : f32[4,8]
          %4 = fused(kind='pointwise', shape=[4, 8], body=[['pow.Scalar', [%0, %2], [], 'f32']], outputs=[0], members=[4]) : f32[4,8]
          return (%3, %4)
        }""",  # noqa: E501
    )


def test_integer_and_boolean_literals():
    i64 = TensorType((4, 8), torch.int64)
    b = GraphBuilder()
    y, mask = b.input(i64), b.input(TensorType((4, 8), torch.bool))
    three = call(b, "full.default", [[], 3], TensorType((), torch.int64), dtype=torch.int64)
    true = call(b, "scalar_tensor.default", [1], TensorType((), torch.bool), dtype=torch.bool)
    a = call(b, "mul.Tensor", [V(y), V(three)], i64)
    keep = call(b, "logical_and.default", [V(mask), V(true)], TensorType((4, 8), torch.bool))
    w = call(b, "where.self", [V(keep), V(a), V(y)], i64)
    check_codegen_pass(
        fuse,
        b.build([w]),
        """
        graph(%0: i64[4,8], %1: b8[4,8]) {
          %2 = fused(kind='pointwise', shape=[4, 8], body=[['mul.Tensor', [%0, Lit(3,i64)], [], 'i64'], ['logical_and.default', [%1, Lit(True,b8)], [], 'b8'], ['where.self', [Val(1), Val(0), %0], [], 'i64']], outputs=[2], members=[4, 5, 6]) : i64[4,8]
          return (%2)
        }""",  # noqa: E501
    )


def test_a_group_of_nothing_but_copies_is_left_to_aten():
    # one of each copy op in one group: still only copies
    b = GraphBuilder()
    x, y = b.input(f32(4, 8)), b.input(f32(4, 8))
    c = call(b, "clone.default", [V(x)], f32(4, 8))
    al = call(b, "alias.default", [V(c)], f32(4, 8))
    tc = call(b, "_to_copy.default", [V(al)], f32(4, 8), dtype=torch.float32)
    cp = call(b, "copy.default", [V(y), V(tc)], f32(4, 8))
    g = b.build([cp])
    check_codegen_pass(fuse, g, str(g))


def test_a_reduction_of_a_value_of_unknown_type_stays():
    # an opaque call whose result type is not known: its row sum is left to ATen
    b = GraphBuilder()
    x = b.input(f32(4, 8))
    o = b.add(Node("opaque.aten::relu.default", (x,), (In(0),), (), (None,)))
    s = call(b, "sum.dim_IntList", [V(o), [-1], True], f32(4, 1))
    g = b.build([s])
    check_codegen_pass(fuse, g, str(g))


def test_a_group_that_grows_a_dependency_later_still_blocks_a_cycle():
    # %8 reads group G (relu) when G depends on nothing; G then takes add(G, T @ w2), which
    # depends on T (exp).  add(T, %8) must not join T: T -> G -> %8 -> T would be a cycle
    b = GraphBuilder()
    x, y = b.input(f32(16, 16)), b.input(f32(16, 8))
    w, w2 = b.input(f32(8, 16)), b.input(f32(16, 8))
    t = call(b, "exp.default", [V(x)], f32(16, 16))
    g1 = call(b, "relu.default", [V(y)], f32(16, 8))
    j = call(b, "mm.default", [V(g1), V(w)], f32(16, 16))
    k = call(b, "mm.default", [V(t), V(w2)], f32(16, 8))
    g2 = call(b, "add.Tensor", [V(g1), V(k)], f32(16, 8))
    n = call(b, "add.Tensor", [V(t), V(j)], f32(16, 16))
    check_codegen_pass(
        fuse,
        b.build([n, g2]),
        """
        graph(%0: f32[16,16], %1: f32[16,8], %2: f32[8,16], %3: f32[16,8]) {
          %4 = fused(kind='pointwise', shape=[16, 16], body=[['exp.default', [%0], [], 'f32']], outputs=[0], members=[4]) : f32[16,16]
          %5 = mm.default(%4, %3) : f32[16,8]
          %6 = fused(kind='pointwise', shape=[16, 8], body=[['relu.default', [%1], [], 'f32'], ['add.Tensor', [Val(0), %5], [], 'f32']], outputs=[0, 1], members=[5, 8]) : f32[16,8], f32[16,8]
          %7 = getitem(%6, 0) : f32[16,8]
          %8 = getitem(%6, 1) : f32[16,8]
          %9 = mm.default(%7, %2) : f32[16,16]
          %10 = fused(kind='pointwise', shape=[16, 16], body=[['add.Tensor', [%4, %9], [], 'f32']], outputs=[0], members=[9]) : f32[16,16]
          return (%10, %8)
        }""",  # noqa: E501
    )


def test_a_softmax_joins_its_pointwise_producer_and_then_takes_no_reduction():
    b = GraphBuilder()
    x = b.input(f32(8, 16))
    a = call(b, "exp.default", [V(x)], f32(8, 16))
    sm = call(b, "_softmax.default", [V(a), -1, False], f32(8, 16))
    s = call(b, "sum.dim_IntList", [V(a), [-1], True], f32(8, 1))
    check_codegen_pass(
        fuse,
        b.build([sm, s]),
        """
        graph(%0: f32[8,16]) {
          %1 = fused(kind='rows', shape=[8, 16], body=[['exp.default', [%0], [], 'f32'], ['_softmax.default', [Val(0), -1, False], [], 'f32']], outputs=[0, 1], members=[1, 2]) : f32[8,16], f32[8,16]
          %2 = getitem(%1, 0) : f32[8,16]
          %3 = getitem(%1, 1) : f32[8,16]
          %4 = fused(kind='rows', shape=[8, 16], body=[['sum.dim_IntList', [%2, [-1], True], [], 'f32']], outputs=[0], members=[3]) : f32[8,1]
          return (%3, %4)
        }""",  # noqa: E501
    )
