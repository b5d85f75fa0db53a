"""Golden tests for rule cases the captured-model tests do not reach: simplify's transpose / t
rules and neutral numbers on the left or held in a one-element constant, copies to a device,
the layout pass on ``_to_copy``, and dce's treatment of unused scalar inputs."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import V, call, check_pass, f32

from kiln.config import config
from kiln.ir import GraphBuilder, Node
from kiln.passes.dce import dce
from kiln.passes.layout import layout
from kiln.passes.simplify import simplify, src


def _simplify_then_dce(g):
    return dce(simplify(g))


@pytest.fixture
def checks():
    """KILN_CHECKS on: a rule that raises fails the test instead of being counted."""
    saved = config.checks
    config.update(checks=True)
    yield
    config.update(checks=saved)


def test_transposes_cancel_and_neutral_numbers_on_either_side_disappear(checks):
    b = GraphBuilder()
    x, v = b.input(f32(4, 3)), b.input(f32(5))
    t1 = call(b, "transpose.int", [V(x), 0, 1], f32(3, 4))
    t2 = call(b, "transpose.int", [V(t1), -1, 0], f32(4, 3))  # cancels t1
    tt = call(b, "t.default", [V(call(b, "t.default", [V(t2)], f32(3, 4)))], f32(4, 3))
    same = call(b, "transpose.int", [V(tt), 1, 1], f32(4, 3))  # the identity
    p = call(b, "permute.default", [V(same), [1, 0]], f32(3, 4))
    mixed = call(b, "t.default", [V(p)], f32(4, 3))  # t of a permute: cancels
    e = call(b, "exp.default", [V(mixed)], f32(4, 3))
    one, zero = b.constant(torch.ones(())), b.constant(torch.zeros(()))  # one element each
    m = call(b, "mul.Tensor", [V(one), V(e)], f32(4, 3))  # 1 * e
    # -0.0 + m is m for every m (+0.0 + m is not: -0.0 + 0.0 is +0.0)
    a = call(b, "add.Tensor", [V(b.constant(torch.tensor(-0.0))), V(m)], f32(4, 3))
    scaled = call(b, "add.Tensor", [V(zero), V(a)], f32(4, 3), alpha=2)  # 0 + 2a: stays
    m1 = call(b, "mul.Tensor", [V(scaled), V(one)], f32(4, 3))  # * 1
    dev = call(b, "_to_copy.default", [V(m1)], f32(4, 3), device=torch.device("cpu"))  # stays
    n = call(b, "neg.default", [V(dev)], f32(4, 3))
    tv = call(b, "t.default", [V(v)], f32(5))  # t of a vector: the vector
    ev = call(b, "exp.default", [V(tv)], f32(5))
    num = call(b, "mul.Tensor", [V(one), 2.0], f32())  # 1 * 2.0: no graph value to return
    check_pass(
        _simplify_then_dce,
        b.build([n, ev, num]),
        """
        graph(%0: f32[4,3], %1: f32[5]) {
          %2 = exp.default(%0) : f32[4,3]
          %3 = constant[0] : f32[]
          %4 = constant[1] : f32[]
          %5 = add.Tensor(%4, %2, alpha=2) : f32[4,3]
          %6 = _to_copy.default(%5, device=device(type='cpu')) : f32[4,3]
          %7 = neg.default(%6) : f32[4,3]
          %8 = exp.default(%1) : f32[5]
          %9 = mul.Tensor(%3, 2.0) : f32[]
          return (%7, %8, %9)
        }""",
    )


def test_src_names_the_node_whose_first_argument_is_not_a_graph_value():
    with pytest.raises(ValueError, match="neg.default: first argument is not a graph value"):
        src(Node("neg.default", (), (1.0,), (), (f32(),)))


def test_layout_bypasses_a_same_dtype_copy_feeding_a_matmul():
    b = GraphBuilder()
    x, w = b.input(f32(8, 4)), b.input(f32(8, 16))
    t = call(b, "t.default", [V(x)], f32(4, 8))
    c = call(b, "_to_copy.default", [V(t)], f32(4, 8), dtype=torch.float32, layout=torch.strided)
    m = call(b, "mm.default", [V(c), V(w)], f32(4, 16))
    check_pass(
        layout,
        b.build([m]),
        """
        graph(%0: f32[8,4], %1: f32[8,16]) {
          %2 = t.default(%0) : f32[4,8]
          %3 = _to_copy.default(%2, dtype=torch.float32, layout=torch.strided) : f32[4,8]
          %4 = mm.default(%2, %1) : f32[4,16]
          return (%4)
        }""",
    )


def test_layout_keeps_a_copy_to_a_device():
    b = GraphBuilder()
    x, w = b.input(f32(8, 4)), b.input(f32(8, 16))
    t = call(b, "t.default", [V(x)], f32(4, 8))
    c = call(b, "_to_copy.default", [V(t)], f32(4, 8), device=torch.device("cpu"))
    m = call(b, "mm.default", [V(c), V(w)], f32(4, 16))
    g = b.build([m])
    check_pass(layout, g, str(g))


def test_a_transpose_stays_and_a_non_mutating_opaque_call_does_not_keep_copies(checks):
    # transpose(x, 0, 1) of a square x is no identity (same type, other values); the clone goes although the graph holds an opaque
    # call (it does not write its inputs)
    b = GraphBuilder()
    x = b.input(f32(4, 4))
    tr = call(b, "transpose.int", [V(x), 0, 1], f32(4, 4))
    c = call(b, "clone.default", [V(x)], f32(4, 4))
    e = call(b, "exp.default", [V(c)], f32(4, 4))
    o = call(b, "opaque.aten::add.Tensor", [V(x), V(x)], f32(4, 4))
    check_pass(
        _simplify_then_dce,
        b.build([tr, e, o]),
        """
        graph(%0: f32[4,4]) {
          %1 = transpose.int(%0, 0, 1) : f32[4,4]
          %2 = exp.default(%0) : f32[4,4]
          %3 = opaque.aten::add.Tensor(%0, %0) : f32[4,4]
          return (%1, %2, %3)
        }""",
    )


def test_layout_keeps_a_copy_to_another_layout():
    # the pass's decision only: ATen itself refuses this conversion, so the graph is not run
    b = GraphBuilder()
    x, w = b.input(f32(8, 4)), b.input(f32(8, 16))
    t = call(b, "t.default", [V(x)], f32(4, 8))
    c = call(b, "_to_copy.default", [V(t)], f32(4, 8), layout=torch.sparse_coo)
    m = call(b, "mm.default", [V(c), V(w)], f32(4, 16))
    g = b.build([m])
    assert str(layout(g)) == str(g)


def test_simplify_keeps_copies_to_another_layout_or_to_pinned_memory(checks):
    # the pass's decision only: on this CPU-only build ATen refuses both, so nothing is run
    b = GraphBuilder()
    x = b.input(f32(4, 8))
    sparse = call(b, "_to_copy.default", [V(x)], f32(4, 8), layout=torch.sparse_coo)
    pinned = call(b, "_to_copy.default", [V(x)], f32(4, 8), pin_memory=True)
    s = call(b, "add.Tensor", [V(sparse), V(pinned)], f32(4, 8))
    g = b.build([s])
    assert str(simplify(g)) == str(g)


def test_dce_keeps_unused_scalar_inputs():
    # the caller passes every input: an unused scalar stays in the signature
    b = GraphBuilder()
    x = b.input(f32(4))
    b.scalar("float")
    y = call(b, "neg.default", [V(x)], f32(4))
    check_pass(
        dce,
        b.build([y]),
        """
        graph(%0: f32[4], %1: float) {
          %2 = neg.default(%0) : f32[4]
          return (%2)
        }""",
    )


def test_only_a_literal_exponent_two_squares_and_view_of_reshape_stays_a_reshape(checks):
    # x ** 3 stays; view(reshape(t(x))) becomes one reshape of t(x) (t(x) is not contiguous,
    # so a view of it would fail)
    b = GraphBuilder()
    x = b.input(f32(8, 4))
    cube = call(b, "pow.Tensor_Scalar", [V(x), 3.0], f32(8, 4))
    t = call(b, "t.default", [V(x)], f32(4, 8))
    r = call(b, "reshape.default", [V(t), [32]], f32(32))
    v = call(b, "view.default", [V(r), [2, 16]], f32(2, 16))
    check_pass(
        _simplify_then_dce,
        b.build([cube, v]),
        """
        graph(%0: f32[8,4]) {
          %1 = pow.Tensor_Scalar(%0, 3.0) : f32[8,4]
          %2 = t.default(%0) : f32[4,8]
          %3 = reshape.default(%2, [2, 16]) : f32[2,16]
          return (%1, %3)
        }""",
    )


def test_the_pipeline_logs_each_pass_with_kiln_log_passes(capsys):
    from kiln.passes.pipeline import PIPELINE_NAMES, run_pipeline

    b = GraphBuilder()
    x = b.input(f32(4))
    g = b.build([call(b, "neg.default", [V(x)], f32(4))])
    saved = config.log
    config.update(log="passes")
    try:
        run_pipeline(g)
    finally:
        config.update(log=saved)
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [f"[kiln] pass {p}" for p in PIPELINE_NAMES]
    assert all(ln.endswith(" ms, 2 nodes") for ln in lines)


def test_a_raising_rule_names_the_fix(checks):
    from kiln.passes.rewrite import Rule, RuleError, apply_rules

    b = GraphBuilder()
    x = b.input(f32(4))
    g = b.build([call(b, "neg.default", [V(x)], f32(4))])
    with pytest.raises(
        RuleError, match="a rule must return None for a node it does not match: fix"
    ):
        apply_rules(g, [Rule("bad", ("neg.default",), lambda rw, n: n.args[5])])
