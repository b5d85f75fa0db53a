"""A rewrite rule that raises is a bug: loud under KILN_CHECKS=1, counted by name otherwise."""

from __future__ import annotations

import pytest
from _passes_testlib import V, call, f32

from kiln import metrics
from kiln.config import config
from kiln.ir import GraphBuilder
from kiln.passes.rewrite import Rule, RuleError, apply_rules


def _graph():
    b = GraphBuilder()
    x = b.input(f32(4))
    return b.build([call(b, "sin.default", [V(x)], f32(4))])


def _buggy(rw, n):
    return n.args[7]  # IndexError: the rule assumes arguments the node does not have


@pytest.fixture
def checks():
    saved = config.checks
    yield
    config.update(checks=saved)


def test_a_raising_rule_fails_loudly_with_checks(checks):
    config.update(checks=True)
    with pytest.raises(RuleError, match="'buggy' raised IndexError on sin.default"):
        apply_rules(_graph(), [Rule("buggy", ("sin.default",), _buggy)])


def test_a_raising_rule_is_counted_without_checks(checks):
    config.update(checks=False)
    before = metrics.get("rewrite_rule_errors.buggy")
    g = _graph()
    assert apply_rules(g, [Rule("buggy", ("sin.default",), _buggy)]) is g
    assert metrics.get("rewrite_rule_errors.buggy") == before + 1
