"""IR: printing, structural hash, verifier."""

import pytest
import torch

from kiln.ir import GraphBuilder, In, Node, TensorType, VerificationError, verify
from kiln.ir.ops import Category, category

F4 = TensorType((4,), torch.float32)


def _g(alpha=1):
    b = GraphBuilder()
    x = b.input(F4)
    s = b.scalar("float")
    y = b.add(Node("add.Tensor", (x, x), (In(0), In(1)), (("alpha", alpha),), (F4,)))
    z = b.add(Node("mul.Tensor", (y, s), (In(0), In(1)), (), (F4,)))
    return b.build([z])


def test_printer():
    assert str(_g()) == (
        "graph(%0: f32[4], %1: float) {\n"
        "  %2 = add.Tensor(%0, %0, alpha=1) : f32[4]\n"
        "  %3 = mul.Tensor(%2, %1) : f32[4]\n"
        "  return (%3)\n"
        "}"
    )


def test_hash_is_structural():
    assert _g().hash == _g().hash
    assert _g().hash != _g(alpha=2).hash


def test_categories():
    assert category("add.Tensor") is Category.ELEMENTWISE
    assert category("mm.default") is Category.MATMUL
    assert category("_softmax.default") is Category.REDUCTION
    assert category("t.default") is Category.VIEW
    assert category("native_dropout.default") is Category.RANDOM
    assert category("opaque.aten::nonzero.default") is Category.OPAQUE


def test_verifier_catches_bad_graphs():
    verify(_g(), deep=True)
    b = GraphBuilder()
    x = b.input(F4)
    b.nodes.append(Node("add.Tensor", (x,), (In(0), In(1)), (), (F4,)))
    with pytest.raises(VerificationError, match="template uses inputs"):
        verify(b.build([1]))
    b = GraphBuilder()
    x = b.input(F4)
    b.nodes.append(Node("frobnicate.default", (x,), (In(0),), (), (F4,)))
    with pytest.raises(VerificationError, match="unknown op"):
        verify(b.build([1]))
    b = GraphBuilder()
    x = b.input(F4)
    b.nodes.append(Node("neg.default", (x,), (In(0),), (), (TensorType((5,), torch.float32),)))
    with pytest.raises(VerificationError, match="ops infer"):
        verify(b.build([1]), deep=True)


def test_verifier_catches_a_symbolic_size_text_in_a_size_list():
    # a shape-generic graph's types hold sizes as text ("s0"); a rewrite that copies a type's
    # shape into a view's size list makes a graph ATen cannot run (view() raises TypeError)
    sym = TensorType(("s0", 4), torch.float32)
    b = GraphBuilder()
    x = b.input(sym)
    n = b.scalar("int")
    b.add(Node("view.default", (x, n), (In(0), [In(1), 4]), (), (sym,)))
    verify(b.build([2]))  # sizes as In markers: fine
    b = GraphBuilder()
    x = b.input(sym)
    b.add(Node("view.default", (x,), (In(0), ["s0", 4]), (), (sym,)))
    with pytest.raises(VerificationError, match="symbolic size 's0'"):
        verify(b.build([1]))
