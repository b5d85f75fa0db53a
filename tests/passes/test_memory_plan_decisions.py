"""Golden tests for the buffer placement decisions of memory planning (kiln/passes/memory_plan.py):
lifetimes through getitems of multi-output kernels and through calls that may return views,
in-place reuse of a buffer that dies at a kernel, outputs written into the graph input they
update (and when that is not allowed), and graph inputs, which are never reused.

Each case compares the exact placements after ``memory_plan`` and runs the planned graph with the
C++ backend twice (slots persist between runs) against the reference interpreter."""

from __future__ import annotations

from _fused_testlib import check_codegen_pass
import torch
from _passes_testlib import V, call, f32

from kiln.codegen.cpp import fuse_claimed as fuse
from kiln.ir import Graph, GraphBuilder, In, Node, TensorType, verify
from kiln.passes.memory_plan import memory_plan


def _writeback(b: GraphBuilder, dst: int, src: int, t: TensorType) -> None:
    b.add(Node("writeback", (dst, src), (In(0), In(1)), (), (t,)))


def _plan(g: Graph, expected: str) -> Graph:
    return check_codegen_pass(memory_plan, fuse(g), expected, ref=g)


def _getitems_live_on(update_first: bool) -> Graph:
    """e, s = rows kernel(x); r = relu(e @ w) while e is alive; t = (e @ r) * s after e died.
    With ``update_first``, a parameter update written back into its input comes first."""
    b = GraphBuilder()
    x, w = b.input(f32(16, 16)), b.input(f32(16, 16))
    if update_first:
        p, gr = b.input(f32(4, 8)), b.input(f32(4, 8))
        u = call(b, "sub.Tensor", [V(p), V(gr)], f32(4, 8), alpha=0.1)
        _writeback(b, p, u, f32(4, 8))
    e = call(b, "exp.default", [V(x)], f32(16, 16))
    s = call(b, "sum.dim_IntList", [V(e), [-1], True], f32(16, 1))
    m = call(b, "mm.default", [V(e), V(w)], f32(16, 16))
    r = call(b, "relu.default", [V(m)], f32(16, 16))
    m2 = call(b, "mm.default", [V(e), V(r)], f32(16, 16))  # e's last use
    t = call(b, "mul.Tensor", [V(m2), V(s)], f32(16, 16))
    o = call(b, "mm.default", [V(t), V(r)], f32(16, 16))
    return b.build([o])


def test_outputs_of_a_multi_output_kernel_live_until_their_getitems_last_use():
    # %3 (slot 0) is read by the matmul %7 after relu's kernel: relu takes a new slot 2; the mul
    # kernel after %7 reuses slot 0
    _plan(
        _getitems_live_on(False),
        """
        graph(%0: f32[16,16], %1: f32[16,16]) {
          %2 = fused(kind='rows', shape=[16, 16], body=[['exp.default', [%0], [], 'f32'], ['sum.dim_IntList', [Val(0), [-1], True], [], 'f32']], outputs=[0, 1], members=[2, 3], placement=[0, 1]) : f32[16,16], f32[16,1]
          %3 = getitem(%2, 0) : f32[16,16]
          %4 = getitem(%2, 1) : f32[16,1]
          %5 = mm.default(%3, %1) : f32[16,16]
          %6 = fused(kind='pointwise', shape=[16, 16], body=[['relu.default', [%5], [], 'f32']], outputs=[0], members=[5], placement=[2]) : f32[16,16]
          %7 = mm.default(%3, %6) : f32[16,16]
          %8 = fused(kind='pointwise', shape=[16, 16], body=[['mul.Tensor', [%7, %4], [], 'f32']], outputs=[0], members=[7], placement=[0]) : f32[16,16]
          %9 = mm.default(%8, %6) : f32[16,16]
          return (%9)
        }""",  # noqa: E501
    )


def test_lifetimes_after_a_writeback_are_still_tracked():
    _plan(
        _getitems_live_on(True),
        """
        graph(%0: f32[16,16], %1: f32[16,16], %2: f32[4,8], %3: f32[4,8]) {
          %4 = fused(kind='pointwise', shape=[4, 8], body=[['sub.Tensor', [%2, %3], [['alpha', 0.1]], 'f32']], outputs=[0], members=[4], placement=[['arg', 0]]) : f32[4,8]
          %5 = writeback(%2, %4) : f32[4,8]
          %6 = fused(kind='rows', shape=[16, 16], body=[['exp.default', [%0], [], 'f32'], ['sum.dim_IntList', [Val(0), [-1], True], [], 'f32']], outputs=[0, 1], members=[6, 7], placement=[0, 1]) : f32[16,16], f32[16,1]
          %7 = getitem(%6, 0) : f32[16,16]
          %8 = getitem(%6, 1) : f32[16,1]
          %9 = mm.default(%7, %1) : f32[16,16]
          %10 = fused(kind='pointwise', shape=[16, 16], body=[['relu.default', [%9], [], 'f32']], outputs=[0], members=[9], placement=[2]) : f32[16,16]
          %11 = mm.default(%7, %10) : f32[16,16]
          %12 = fused(kind='pointwise', shape=[16, 16], body=[['mul.Tensor', [%11, %8], [], 'f32']], outputs=[0], members=[11], placement=[0]) : f32[16,16]
          %13 = mm.default(%12, %10) : f32[16,16]
          return (%13)
        }""",  # noqa: E501
    )


def test_an_output_returned_to_the_caller_is_fresh_and_the_next_output_still_gets_a_slot():
    b = GraphBuilder()
    x, w = b.input(f32(16, 16)), b.input(f32(1, 16))
    e = call(b, "exp.default", [V(x)], f32(16, 16))
    s = call(b, "sum.dim_IntList", [V(e), [-1], True], f32(16, 1))
    m = call(b, "mm.default", [V(s), V(w)], f32(16, 16))
    _plan(
        b.build([e, m]),
        """
        graph(%0: f32[16,16], %1: f32[1,16]) {
          %2 = fused(kind='rows', shape=[16, 16], body=[['exp.default', [%0], [], 'f32'], ['sum.dim_IntList', [Val(0), [-1], True], [], 'f32']], outputs=[0, 1], members=[2, 3], placement=[None, 0]) : f32[16,16], f32[16,1]
          %3 = getitem(%2, 0) : f32[16,16]
          %4 = getitem(%2, 1) : f32[16,1]
          %5 = mm.default(%4, %1) : f32[16,16]
          return (%3, %5)
        }""",  # noqa: E501
    )


def test_a_value_read_through_a_call_that_may_return_a_view_stays_alive():
    # an opaque call may return a view of any of its inputs: %2 and %4 live as long as %5 does,
    # so the second relu's kernel cannot take slot 0 or 1
    b = GraphBuilder()
    x, w = b.input(f32(16, 16)), b.input(f32(16, 16))
    a = call(b, "neg.default", [V(x)], f32(16, 16))
    m = call(b, "mm.default", [V(a), V(w)], f32(16, 16))
    r = call(b, "relu.default", [V(m)], f32(16, 16))
    o = call(b, "opaque.aten::add.Tensor", [V(a), V(r)], f32(16, 16))
    m2 = call(b, "mm.default", [V(o), V(w)], f32(16, 16))
    c = call(b, "relu.default", [V(m2)], f32(16, 16))
    f = call(b, "mm.default", [V(c), V(o)], f32(16, 16))
    _plan(
        b.build([f]),
        """
        graph(%0: f32[16,16], %1: f32[16,16]) {
          %2 = fused(kind='pointwise', shape=[16, 16], body=[['neg.default', [%0], [], 'f32']], outputs=[0], members=[2], placement=[0]) : f32[16,16]
          %3 = mm.default(%2, %1) : f32[16,16]
          %4 = fused(kind='pointwise', shape=[16, 16], body=[['relu.default', [%3], [], 'f32']], outputs=[0], members=[4], placement=[1]) : f32[16,16]
          %5 = opaque.aten::add.Tensor(%2, %4) : f32[16,16]
          %6 = mm.default(%5, %1) : f32[16,16]
          %7 = fused(kind='pointwise', shape=[16, 16], body=[['relu.default', [%6], [], 'f32']], outputs=[0], members=[7], placement=[2]) : f32[16,16]
          %8 = mm.default(%7, %5) : f32[16,16]
          return (%8)
        }""",  # noqa: E501
    )


def test_a_kernel_writes_in_place_into_an_input_buffer_that_dies_there():
    b = GraphBuilder()
    x, w = b.input(f32(16, 16)), b.input(f32(16, 16))
    a = call(b, "exp.default", [V(x)], f32(16, 16))
    m = call(b, "mm.default", [V(a), V(w)], f32(16, 16))
    c = call(b, "add.Tensor", [V(m), V(a)], f32(16, 16))  # a's last use
    o = call(b, "mm.default", [V(c), V(w)], f32(16, 16))
    _plan(
        b.build([o]),
        """
        graph(%0: f32[16,16], %1: f32[16,16]) {
          %2 = fused(kind='pointwise', shape=[16, 16], body=[['exp.default', [%0], [], 'f32']], outputs=[0], members=[2], placement=[0]) : f32[16,16]
          %3 = mm.default(%2, %1) : f32[16,16]
          %4 = fused(kind='pointwise', shape=[16, 16], body=[['add.Tensor', [%3, %2], [], 'f32']], outputs=[0], members=[4], placement=[0]) : f32[16,16]
          %5 = mm.default(%4, %1) : f32[16,16]
          return (%5)
        }""",  # noqa: E501
    )


def test_a_graph_input_that_dies_at_a_kernel_is_never_written():
    # %1 is read last by exp's kernel, but it belongs to the caller: a new slot, not ("arg", 0)
    b = GraphBuilder()
    x0, x1, w = b.input(f32(16, 16)), b.input(f32(16, 16)), b.input(f32(16, 16))
    a = call(b, "exp.default", [V(x1)], f32(16, 16))
    o = call(b, "mm.default", [V(a), V(w)], f32(16, 16))
    o2 = call(b, "mm.default", [V(x0), V(w)], f32(16, 16))
    g = b.build([o, o2])
    _plan(
        g,
        """
        graph(%0: f32[16,16], %1: f32[16,16], %2: f32[16,16]) {
          %3 = fused(kind='pointwise', shape=[16, 16], body=[['exp.default', [%1], [], 'f32']], outputs=[0], members=[3], placement=[0]) : f32[16,16]
          %4 = mm.default(%3, %2) : f32[16,16]
          %5 = mm.default(%0, %2) : f32[16,16]
          return (%4, %5)
        }""",  # noqa: E501
    )


def _two_updates(view_read: bool) -> Graph:
    """Two parameter updates fused horizontally, each written back into its parameter; with
    ``view_read`` the first one also reads its parameter through a transpose."""
    b = GraphBuilder()
    p1, p2, g1, g2 = (b.input(f32(8, 8)) for _ in range(4))
    other = call(b, "t.default", [V(p1)], f32(8, 8)) if view_read else g1
    u1 = call(b, "sub.Tensor", [V(p1), V(other)], f32(8, 8), alpha=0.1)
    u2 = call(b, "sub.Tensor", [V(p2), V(g2)], f32(8, 8), alpha=0.1)
    loss = call(b, "sum.default", [V(u1)], f32())
    _writeback(b, p1, u1, f32(8, 8))
    _writeback(b, p2, u2, f32(8, 8))
    return b.build([loss])


def test_every_output_of_a_kernel_is_written_into_the_input_it_updates():
    _plan(
        _two_updates(False),
        """
        graph(%0: f32[8,8], %1: f32[8,8], %2: f32[8,8], %3: f32[8,8]) {
          %4 = fused(kind='pointwise', shape=[8, 8], body=[['sub.Tensor', [%0, %2], [['alpha', 0.1]], 'f32'], ['sub.Tensor', [%1, %3], [['alpha', 0.1]], 'f32']], outputs=[0, 1], members=[4, 5], placement=[['arg', 0], ['arg', 2]]) : f32[8,8], f32[8,8]
          %5 = getitem(%4, 0) : f32[8,8]
          %6 = getitem(%4, 1) : f32[8,8]
          %7 = sum.default(%5) : f32[]
          %8 = writeback(%0, %5) : f32[8,8]
          %9 = writeback(%1, %6) : f32[8,8]
          return (%7)
        }""",  # noqa: E501
    )


def test_an_update_that_reads_its_input_through_a_view_gets_a_buffer_of_its_own():
    # writing %0 in place while reading its transpose %4 would read updated elements: slot 0
    # (the writeback copies); the second update is still written into %1
    _plan(
        _two_updates(True),
        """
        graph(%0: f32[8,8], %1: f32[8,8], %2: f32[8,8], %3: f32[8,8]) {
          %4 = t.default(%0) : f32[8,8]
          %5 = fused(kind='pointwise', shape=[8, 8], body=[['sub.Tensor', [%0, %4], [['alpha', 0.1]], 'f32'], ['sub.Tensor', [%1, %3], [['alpha', 0.1]], 'f32']], outputs=[0, 1], members=[5, 6], strided=[1], placement=[0, ['arg', 2]]) : f32[8,8], f32[8,8]
          %6 = getitem(%5, 0) : f32[8,8]
          %7 = getitem(%5, 1) : f32[8,8]
          %8 = sum.default(%6) : f32[]
          %9 = writeback(%0, %6) : f32[8,8]
          %10 = writeback(%1, %7) : f32[8,8]
          return (%8)
        }""",  # noqa: E501
    )


def test_planning_twice_gives_the_same_plan():
    planned = verify(memory_plan(fuse(_getitems_live_on(True))))
    again = verify(memory_plan(planned))
    assert str(again) == str(planned)
    assert all(sum(k == "placement" for k, _ in n.kwargs) <= 1 for n in again.nodes)


def test_an_update_that_does_not_read_its_input_or_is_returned_is_not_written_into_it():
    # %0's new value does not read %0 (nothing to update in place): slot 0; %1's new value is
    # also returned to the caller, who must not get the parameter's own buffer: fresh
    b = GraphBuilder()
    p1, p2, g1, g2 = (b.input(f32(8, 8)) for _ in range(4))
    u1 = call(b, "mul.Tensor", [V(g1), 2.0], f32(8, 8))
    u2 = call(b, "sub.Tensor", [V(p2), V(g2)], f32(8, 8), alpha=0.1)
    _writeback(b, p1, u1, f32(8, 8))
    _writeback(b, p2, u2, f32(8, 8))
    _plan(
        b.build([u2]),
        """
        graph(%0: f32[8,8], %1: f32[8,8], %2: f32[8,8], %3: f32[8,8]) {
          %4 = fused(kind='pointwise', shape=[8, 8], body=[['mul.Tensor', [%2, 2.0], [], 'f32'], ['sub.Tensor', [%1, %3], [['alpha', 0.1]], 'f32']], outputs=[0, 1], members=[4, 5], placement=[0, None]) : f32[8,8], f32[8,8]
          %5 = getitem(%4, 0) : f32[8,8]
          %6 = getitem(%4, 1) : f32[8,8]
          %7 = writeback(%0, %5) : f32[8,8]
          %8 = writeback(%1, %6) : f32[8,8]
          return (%6)
        }""",  # noqa: E501
    )


def test_an_input_read_after_the_kernel_is_not_overwritten_the_next_one_is():
    # the matmul %8 reads the old %0 after the update kernel: %0's update gets slot 0, %1's is
    # still written into %1
    b = GraphBuilder()
    p1, p2, g1, g2 = (b.input(f32(8, 8)) for _ in range(4))
    u1 = call(b, "sub.Tensor", [V(p1), V(g1)], f32(8, 8), alpha=0.1)
    u2 = call(b, "sub.Tensor", [V(p2), V(g2)], f32(8, 8), alpha=0.1)
    w = b.input(f32(8, 8))
    later = call(b, "mm.default", [V(p1), V(w)], f32(8, 8))
    _writeback(b, p1, u1, f32(8, 8))
    _writeback(b, p2, u2, f32(8, 8))
    _plan(
        b.build([later]),
        """
        graph(%0: f32[8,8], %1: f32[8,8], %2: f32[8,8], %3: f32[8,8], %7: f32[8,8]) {
          %4 = fused(kind='pointwise', shape=[8, 8], body=[['sub.Tensor', [%0, %2], [['alpha', 0.1]], 'f32'], ['sub.Tensor', [%1, %3], [['alpha', 0.1]], 'f32']], outputs=[0, 1], members=[4, 5], placement=[0, ['arg', 2]]) : f32[8,8], f32[8,8]
          %5 = getitem(%4, 0) : f32[8,8]
          %6 = getitem(%4, 1) : f32[8,8]
          %8 = mm.default(%0, %7) : f32[8,8]
          %9 = writeback(%0, %5) : f32[8,8]
          %10 = writeback(%1, %6) : f32[8,8]
          return (%8)
        }""",  # noqa: E501
    )


def test_an_update_of_another_dtype_is_not_written_into_its_input():
    # a bf16 parameter updated in f32 (the writeback converts): the f32 result gets a slot
    b = GraphBuilder()
    p, g = b.input(TensorType((8, 8), torch.bfloat16)), b.input(f32(8, 8))
    pf = call(b, "_to_copy.default", [V(p)], f32(8, 8), dtype=torch.float32)
    u = call(b, "sub.Tensor", [V(pf), V(g)], f32(8, 8), alpha=0.1)
    loss = call(b, "sum.default", [V(u)], f32())
    _writeback(b, p, u, TensorType((8, 8), torch.bfloat16))
    _plan(
        b.build([loss]),
        """
        graph(%0: bf16[8,8], %1: f32[8,8]) {
          %2 = fused(kind='pointwise', shape=[8, 8], body=[['_to_copy.default', [%0], [['dtype', torch.float32]], 'f32'], ['sub.Tensor', [Val(0), %1], [['alpha', 0.1]], 'f32']], outputs=[1], members=[2, 3], placement=[0]) : f32[8,8]
          %3 = sum.default(%2) : f32[]
          %4 = writeback(%0, %2) : bf16[8,8]
          return (%3)
        }""",  # noqa: E501
    )


def test_an_in_place_candidate_after_a_broadcast_input_is_found():
    # the kernel reads the bias %2 (broadcast, not a candidate), the matmul %4, and %3, which
    # dies here: the output takes %3's slot 0 in place
    b = GraphBuilder()
    x, w, bias = b.input(f32(16, 16)), b.input(f32(16, 16)), b.input(f32(16))
    a = call(b, "exp.default", [V(x)], f32(16, 16))
    m = call(b, "mm.default", [V(a), V(w)], f32(16, 16))
    c = call(b, "add.Tensor", [V(bias), V(m)], f32(16, 16))
    d = call(b, "mul.Tensor", [V(c), V(a)], f32(16, 16))
    o = call(b, "mm.default", [V(d), V(w)], f32(16, 16))
    _plan(
        b.build([o]),
        """
        graph(%0: f32[16,16], %1: f32[16,16], %2: f32[16]) {
          %3 = fused(kind='pointwise', shape=[16, 16], body=[['exp.default', [%0], [], 'f32']], outputs=[0], members=[3], placement=[0]) : f32[16,16]
          %4 = mm.default(%3, %1) : f32[16,16]
          %5 = fused(kind='pointwise', shape=[16, 16], body=[['add.Tensor', [%2, %4], [], 'f32'], ['mul.Tensor', [Val(0), %3], [], 'f32']], outputs=[1], members=[5, 6], placement=[0]) : f32[16,16]
          %6 = mm.default(%5, %1) : f32[16,16]
          return (%6)
        }""",  # noqa: E501
    )


def test_a_writeback_result_is_its_destination_not_its_source():
    # %4 (the writeback) stands for %0 updated; %3's buffer dies at the writeback, so neg's
    # kernel reuses slot 0 although %4 is read after it
    b = GraphBuilder()
    p, g, w = b.input(f32(8, 8)), b.input(f32(8, 8)), b.input(f32(8, 8))
    u = call(b, "mul.Tensor", [V(g), 2.0], f32(8, 8))
    wb = b.add(Node("writeback", (p, u), (In(0), In(1)), (), (f32(8, 8),)))
    m = call(b, "mm.default", [V(wb), V(w)], f32(8, 8))
    r = call(b, "neg.default", [V(m)], f32(8, 8))
    f = call(b, "mm.default", [V(r), V(wb)], f32(8, 8))
    _plan(
        b.build([f]),
        """
        graph(%0: f32[8,8], %1: f32[8,8], %2: f32[8,8]) {
          %3 = fused(kind='pointwise', shape=[8, 8], body=[['mul.Tensor', [%1, 2.0], [], 'f32']], outputs=[0], members=[3], placement=[0]) : f32[8,8]
          %4 = writeback(%0, %3) : f32[8,8]
          %5 = mm.default(%4, %2) : f32[8,8]
          %6 = fused(kind='pointwise', shape=[8, 8], body=[['neg.default', [%5], [], 'f32']], outputs=[0], members=[6], placement=[0]) : f32[8,8]
          %7 = mm.default(%6, %4) : f32[8,8]
          return (%7)
        }""",  # noqa: E501
    )
