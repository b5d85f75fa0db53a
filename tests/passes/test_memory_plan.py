"""Golden tests for memory planning (kiln/passes/memory_plan.py)."""

from __future__ import annotations

from _fused_testlib import check_codegen_pass
from _passes_testlib import V, call, f32
from test_fuse import chain

from kiln.ir import GraphBuilder, In, Node
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.passes.memory_plan import memory_plan


def test_dead_buffer_reused_and_outputs_fresh(monkeypatch):
    # %3 dies at the matmul: the row kernel's first output takes its slot 0; the graph output
    # gets a fresh buffer (the caller keeps it).  Fused without rows epilogues, so that the
    # row kernel has a full-size output (with them, exp, sum and div are one kernel whose only
    # full-size output is the graph's: tests/passes/test_fuse.py)
    from kiln.passes import row_epilogue

    monkeypatch.setattr(row_epilogue, "ROW_EPILOGUE", False)
    check_codegen_pass(
        memory_plan,
        fuse(chain()),
        """
        graph(%0: f32[8,16], %1: f32[16], %2: f32[16,16]) {
          %3 = fused(kind='pointwise', shape=[8, 16], body=[['add.Tensor', [%0, %1], [], 'f32'], ['relu.default', [Val(0)], [], 'f32']], outputs=[1], members=[3, 4], placement=[0]) : f32[8,16]
          %4 = mm.default(%3, %2) : f32[8,16]
          %5 = fused(kind='rows', shape=[8, 16], body=[['exp.default', [%4], [], 'f32'], ['sum.dim_IntList', [Val(0), [-1], True], [], 'f32']], outputs=[0, 1], members=[6, 7], placement=[0, 1]) : f32[8,16], f32[8,1]
          %6 = getitem(%5, 0) : f32[8,16]
          %7 = getitem(%5, 1) : f32[8,1]
          %8 = fused(kind='pointwise', shape=[8, 16], body=[['div.Tensor', [%6, %7], [], 'f32']], outputs=[0], members=[8], placement=[None]) : f32[8,16]
          return (%8)
        }""",  # noqa: E501
        ref=chain(),
    )


def test_update_written_into_the_input_it_replaces():
    b = GraphBuilder()
    p, g = b.input(f32(4, 8)), b.input(f32(4, 8))
    new = call(b, "sub.Tensor", [V(p), V(g)], f32(4, 8), alpha=0.1)
    loss = call(b, "sum.default", [V(new)], f32())
    b.add(Node("writeback", (p, new), (In(0), In(1)), (), (f32(4, 8),)))
    g = b.build([loss])
    check_codegen_pass(
        memory_plan,
        fuse(g),
        """
        graph(%0: f32[4,8], %1: f32[4,8]) {
          %2 = fused(kind='pointwise', shape=[4, 8], body=[['sub.Tensor', [%0, %1], [['alpha', 0.1]], 'f32']], outputs=[0], members=[2], placement=[['arg', 0]]) : f32[4,8]
          %3 = sum.default(%2) : f32[]
          %4 = writeback(%0, %2) : f32[4,8]
          return (%3)
        }""",  # noqa: E501
        ref=g,
    )
