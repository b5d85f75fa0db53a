"""Tests for the rule engine (kiln/passes/rewrite.py) and the rewriter under it: bounded
iteration, first-match order, and the type/output guards every rule gets for free."""

from __future__ import annotations

from _passes_testlib import V, call, f32, same_results

from kiln.ir import GraphBuilder, In, Node, verify
from kiln.passes import rewrite
from kiln.passes.rewrite import Rule, RuleTable, apply_rules


def _sin_cos_graph():
    b = GraphBuilder()
    x = b.input(f32(4))
    s = call(b, "sin.default", [V(x)], f32(4))
    return b.build([call(b, "exp.default", [V(s)], f32(4))])


def _swap(to: str):
    return lambda rw, n: n.with_(op=to)


def test_rules_that_undo_each_other_terminate():
    # sin -> cos -> sin -> ... : the per-node cap stops it inside a sweep, the sweep cap overall.
    table = RuleTable(
        [
            Rule("sin2cos", ("sin.default",), _swap("cos.default")),
            Rule("cos2sin", ("cos.default",), _swap("sin.default")),
        ]
    )
    out = verify(apply_rules(_sin_cos_graph(), table, max_iters=3, max_per_node=5))
    assert out.nodes[1].op in ("sin.default", "cos.default")
    assert sum(table.hits.values()) <= 3 * 5


def test_sweeps_stop_when_nothing_fires():
    calls = []

    def never(rw, n):
        calls.append(n.op)

    g = _sin_cos_graph()
    assert apply_rules(g, [Rule("never", ("sin.default",), never)]) is g
    assert calls == ["sin.default"]


def test_default_caps_are_small():
    assert rewrite.MAX_ITERS <= 8 and rewrite.MAX_PER_NODE <= 32


def test_first_matching_rule_wins_and_chains_are_seen_rewritten():
    # Both exps become logs: the first rule wins, the second never runs.
    table = RuleTable(
        [
            Rule("to_log", ("exp.default",), _swap("log.default")),
            Rule("to_neg", ("exp.default",), _swap("neg.default")),
        ]
    )
    b = GraphBuilder()
    x = b.input(f32(4))
    e = call(b, "exp.default", [V(x)], f32(4))
    g = b.build([call(b, "exp.default", [V(e)], f32(4))])
    out = verify(apply_rules(g, table))
    assert [n.op for n in out.nodes[1:]] == ["log.default", "log.default"]
    assert table.hits == {"to_log": 2}


def test_replacement_of_another_type_is_refused():
    b = GraphBuilder()
    x = b.input(f32(4))
    y = call(b, "sum.default", [V(x)], f32())
    g = b.build([call(b, "exp.default", [V(y)], f32())])
    out = verify(apply_rules(g, [Rule("bad", ("sum.default",), lambda rw, n: n.inputs[0])]))
    assert str(out) == str(g)


def test_output_is_never_replaced_by_an_input():
    b = GraphBuilder()
    x = b.input(f32(4))
    g = b.build([call(b, "relu.default", [V(x)], f32(4))])
    out = verify(apply_rules(g, [Rule("drop", ("relu.default",), lambda rw, n: n.inputs[0])]))
    assert str(out) == str(g)


def test_rules_may_add_helper_nodes():
    # x * x -> pow(x, 2) built as a new node; numerically the same.
    def to_pow(rw, n):
        if n.inputs[0] != n.inputs[1]:
            return None
        return Node("pow.Tensor_Scalar", (n.inputs[0],), (In(0), 2), (), n.types)

    b = GraphBuilder()
    x = b.input(f32(4))
    m = call(b, "mul.Tensor", [V(x), V(x)], f32(4))
    g = b.build([call(b, "neg.default", [V(m)], f32(4))])
    out = verify(apply_rules(g, [Rule("sq", ("mul.Tensor",), to_pow)]))
    assert out.nodes[1].op == "pow.Tensor_Scalar"
    same_results(g, out)
