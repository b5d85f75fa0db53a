"""Op records (kiln/ir/ops.py): one per op, read by every layer."""

from __future__ import annotations

import operator

import pytest
import torch

from kiln.ir import GraphBuilder, In, Node, TensorType, verify
from kiln.ir.ops import (
    FALLBACKS,
    OPS,
    SIDE_EFFECTS,
    Category,
    defop,
    fallback_reason,
    functional_variant,
    keep_whole_ops,
    record,
    undefop,
)
from kiln.ir.semantics import call_node, infer_types, resolve, types_of
from kiln.lowering import FALLBACK
from kiln.lowering.aten import op_name

F4 = TensorType((4,), torch.float32)


def test_every_record_says_what_the_op_is():
    assert record("add.Tensor").category is Category.ELEMENTWISE
    assert record("mm.default").category is Category.MATMUL
    assert "native_layer_norm_backward" in keep_whole_ops()
    assert "_scaled_dot_product_flash_attention_for_cpu" in keep_whole_ops()
    assert functional_variant("normal_.default") == "normal_functional.default"
    assert functional_variant("add_.Tensor") is None  # the name says it: add.Tensor
    assert SIDE_EFFECTS == {"opaque", "writeback", "rng_saved", "rng_replayed"}
    with pytest.raises(KeyError, match="unknown Kiln op"):
        record("no_such_op.default")


def test_fallback_ops_have_a_reason_and_lower_to_opaque():
    assert FALLBACKS["nonzero"].category is Category.OPAQUE and "nonzero" not in OPS
    assert fallback_reason("nonzero") == "output shape depends on the data"
    assert FALLBACK["item"] == fallback_reason("item")
    assert fallback_reason("not_a_rule") == "no Kiln lowering rule for this op yet"
    assert op_name(torch.ops.aten.nonzero.default) == ("opaque.aten::nonzero.default", False)
    assert op_name(torch.ops.aten.add.Tensor) == ("add.Tensor", True)


def test_reference_implementations_come_from_the_records():
    assert resolve("add.Tensor") is torch.ops.aten.add.Tensor
    assert resolve("pyop.mul") is operator.mul
    assert resolve("getitem") is operator.getitem
    assert resolve("opaque.aten::nonzero.default") is torch.ops.aten.nonzero.default
    x = torch.tensor([1.0, 0.0, 2.0])
    n = Node("opaque.aten::nonzero.default", (0,), (In(0),), ())
    assert call_node(n, [x]).tolist() == [[0], [2]]


def test_a_new_record_defines_evaluation_and_types():
    defop("kiln_test_twice", Category.ELEMENTWISE, impl=lambda op: lambda x: x * 2)
    try:
        b = GraphBuilder()
        x = b.input(F4)
        y = b.add(Node("kiln_test_twice.default", (x,), (In(0),), (), (F4,)))
        g = verify(b.build([y]), deep=True)  # the type rule: the impl on meta tensors
        assert infer_types(g)[1] == (F4,)
        assert call_node(g.nodes[1], [torch.ones(4)]).tolist() == [2.0] * 4
        with pytest.raises(ValueError, match="already defined"):
            defop("kiln_test_twice", Category.ELEMENTWISE)
    finally:
        undefop("kiln_test_twice")
    with pytest.raises(KeyError):
        record("kiln_test_twice.default")


def test_types_of_values():
    assert types_of(torch.ones(2, 3)) == (TensorType((2, 3), torch.float32),)
    assert types_of((torch.ones(1), 3)) == (TensorType((1,), torch.float32), None)
    assert types_of(2.5) == (TensorType((), None, "float"),)
