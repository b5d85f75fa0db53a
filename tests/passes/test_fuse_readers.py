"""Golden tests for horizontal fusion's reader rule (kiln/passes/fuse.py): a node whose fusible
reader also depends on a group does not join that group sideways (its value would be written out
and read back); it starts its own group and the reader joins it.  Results are checked against the
reference interpreter through the C++ backend."""

from __future__ import annotations

from _fused_testlib import check_codegen_pass
from _passes_testlib import V, call, f32

import torch

from kiln.codegen.cpp import fuse_claimed as fuse
from kiln.ir import GraphBuilder, TensorType


def test_a_recomputed_gate_is_fused_with_its_reader_not_beside_an_earlier_kernel():
    # g = exp(x) * 2 (a kernel); m = mm(g, w) depends on it; s = sigmoid(y) is independent of g
    # and could join g's kernel sideways, but its reader s * m cannot (m depends on g's kernel)
    b = GraphBuilder()
    x, y, w = b.input(f32(4, 8)), b.input(f32(4, 8)), b.input(f32(8, 8))
    e = call(b, "exp.default", [V(x)], f32(4, 8))
    g = call(b, "mul.Tensor", [V(e), 2.0], f32(4, 8))
    m = call(b, "mm.default", [V(g), V(w)], f32(4, 8))
    s = call(b, "sigmoid.default", [V(y)], f32(4, 8))
    o = call(b, "mul.Tensor", [V(s), V(m)], f32(4, 8))
    check_codegen_pass(
        fuse,
        b.build([o]),
        """
        graph(%0: f32[4,8], %1: f32[4,8], %2: f32[8,8]) {
          %3 = fused(kind='pointwise', shape=[4, 8], body=[['exp.default', [%0], [], 'f32'], ['mul.Tensor', [Val(0), 2.0], [], 'f32']], outputs=[1], members=[3, 4]) : f32[4,8]
          %4 = mm.default(%3, %2) : f32[4,8]
          %5 = fused(kind='pointwise', shape=[4, 8], body=[['sigmoid.default', [%1], [], 'f32'], ['mul.Tensor', [Val(0), %4], [], 'f32']], outputs=[1], members=[6, 7]) : f32[4,8]
          return (%5)
        }""",  # noqa: E501
    )


def test_independent_updates_still_fuse_sideways():
    # two parameter-update-like chains: the second chain's readers depend only on inputs
    b = GraphBuilder()
    p1, g1, p2, g2 = (b.input(f32(4, 8)) for _ in range(4))
    u1 = call(
        b, "sub.Tensor", [V(p1), V(call(b, "mul.Tensor", [V(g1), 0.1], f32(4, 8)))], f32(4, 8)
    )
    u2 = call(
        b, "sub.Tensor", [V(p2), V(call(b, "mul.Tensor", [V(g2), 0.1], f32(4, 8)))], f32(4, 8)
    )
    out = check_codegen_pass(
        fuse,
        b.build([u1, u2]),
        """
        graph(%0: f32[4,8], %1: f32[4,8], %2: f32[4,8], %3: f32[4,8]) {
          %4 = fused(kind='pointwise', shape=[4, 8], body=[['mul.Tensor', [%1, 0.1], [], 'f32'], ['sub.Tensor', [%0, Val(0)], [], 'f32'], ['mul.Tensor', [%3, 0.1], [], 'f32'], ['sub.Tensor', [%2, Val(2)], [], 'f32']], outputs=[1, 3], members=[4, 5, 6, 7]) : f32[4,8], f32[4,8]
          %5 = getitem(%4, 0) : f32[4,8]
          %6 = getitem(%4, 1) : f32[4,8]
          return (%5, %6)
        }""",  # noqa: E501
    )
    assert sum(n.op == "fused" for n in out.nodes) == 1


def test_a_reader_fused_with_nothing_does_not_split_a_group():
    # both comparisons are read by bitwise_and (which this backend does not fuse): they still
    # share one kernel
    b = GraphBuilder()
    x, y = b.input(f32(4, 8)), b.input(f32(4, 8))
    b8 = TensorType((4, 8), torch.bool)
    le = call(b, "le.Tensor", [V(x), V(y)], b8)
    eq = call(b, "eq.Tensor", [V(x), V(y)], b8)
    a1 = call(b, "bitwise_and.Tensor", [V(le), V(le)], b8)
    a2 = call(b, "bitwise_and.Tensor", [V(a1), V(eq)], b8)
    out = fuse(b.build([a2]))
    fused = [n for n in out.nodes if n.op == "fused"]
    assert len(fused) == 1
    assert {e[0] for e in fused[0].kwarg("body")} == {"le.Tensor", "eq.Tensor"}
