"""The typed fused-kernel view (kiln/ir/kernel.py) round-trips what fusion writes on a node."""

from __future__ import annotations

import pickle

import torch

from kiln.ir import GraphBuilder, In, Node, TensorType
from kiln.ir.kernel import FusedKernel, InPlace, LoopKind, OutKind, Val
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.passes.memory_plan import memory_plan

F = TensorType((8, 16), torch.float32)


def _update_graph():
    """p <- relu(p + g) written back into p: fused, then placed in p's own buffer."""
    b = GraphBuilder()
    p, g = b.input(F), b.input(F)
    s = b.add(Node("add.Tensor", (p, g), (In(0), In(1)), (), (F,)))
    r = b.add(Node("relu.default", (s,), (In(0),), (), (F,)))
    w = b.add(Node("writeback", (p, r), (In(0), In(1)), (), (F,)))
    return b.build([w])


def test_fusion_writes_a_typed_kernel_and_planning_a_typed_placement():
    g = memory_plan(fuse(_update_graph()))
    (node,) = [n for n in g.nodes if n.op == "fused"]
    k = FusedKernel.of(node)
    assert k.kind is LoopKind.POINTWISE and k.shape == (8, 16)
    assert [b.op for b in k.body] == ["add.Tensor", "relu.default"]
    assert k.body[1].args == (Val(0),)
    assert k.placement == (InPlace("arg", 0),)
    assert FusedKernel.of(node.with_(kwargs=k.to_kwargs())) == k
    assert pickle.loads(pickle.dumps(k)) == k
    # printouts and structural hashes read as plain strings and tuples
    assert "kind='pointwise'" in str(g) and "placement=[['arg', 0]]" in str(g)


def test_out_kinds_give_output_shapes():
    s = (4, 5, 6)
    assert OutKind.ROW.shape(s) == (4, 5) and OutKind.ROWK.shape(s) == (4, 5, 1)
    assert OutKind.COL.shape(s) == (6,) and OutKind.COLK.shape(s) == (1, 1, 6)
    assert OutKind.FULL.shape(s) == s
