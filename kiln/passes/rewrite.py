"""A small engine that applies a table of rewrite rules to a graph, with an iteration cap.

A :class:`Rule` names the ops it looks at and a function ``fn(rw, node)`` that returns ``None`` (no
match), an existing value id of the graph being built, or a replacement :class:`Node` (see
:class:`kiln.passes._util.Rewriter`).  :func:`apply_rules` runs forward sweeps until a sweep
changes nothing, and never more than ``max_iters`` sweeps; inside a sweep each node is rewritten at
most ``max_per_node`` times.  Rewrites therefore always terminate, even with a table whose rules
undo each other.

A rule that raises is a bug in the rule (it must return ``None`` for a node it does not match):
with ``KILN_CHECKS=1`` the error propagates as a :class:`RuleError` naming the rule and the node;
otherwise the node is left as it is and the failure is counted in :mod:`kiln.metrics` as
``rewrite_rule_errors.<rule name>``, so a broken rule shows up instead of silently never firing.

    rules = [Rule("neg_neg", ("neg.default",), lambda rw, n: ...)]
    g2 = apply_rules(g, rules)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kiln import metrics
from kiln.config import config
from kiln.ir.graph import Graph, Node
from kiln.passes._util import Rewriter, RuleFn, RuleResult

MAX_ITERS = 4
MAX_PER_NODE = 16


@dataclass(frozen=True)
class Rule:
    name: str
    ops: tuple[str, ...]  # exact Kiln op names ("mul.Tensor") this rule is tried on
    fn: RuleFn


class RuleError(RuntimeError):
    """A rewrite rule raised instead of returning a result (a bug in the rule)."""


class RuleTable:
    """Rules indexed by op; tried in table order, the first that matches wins."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = tuple(rules)
        self.by_op: dict[str, list[Rule]] = {}
        for r in self.rules:
            for op in r.ops:
                self.by_op.setdefault(op, []).append(r)
        self.hits: Counter[str] = Counter()

    def __call__(self, rw: Rewriter, n: Node) -> RuleResult:
        for r in self.by_op.get(n.op, ()):
            try:
                out = r.fn(rw, n)
            except Exception as e:
                if config.checks:
                    raise RuleError(
                        f"rewrite rule {r.name!r} raised {type(e).__name__} on {n.op} ({e}); a "
                        "rule must return None for a node it does not match: fix the rule"
                    ) from e
                metrics.incr(f"rewrite_rule_errors.{r.name}")
                out = None  # counted, and the node left as it is
            if out is not None:
                self.hits[r.name] += 1
                return out
        return None


def apply_rules(
    g: Graph,
    rules: Sequence[Rule] | RuleTable,
    max_iters: int = MAX_ITERS,
    max_per_node: int = MAX_PER_NODE,
) -> Graph:
    """Rewrite ``g`` with ``rules`` until nothing changes, at most ``max_iters`` sweeps."""
    table = rules if isinstance(rules, RuleTable) else RuleTable(rules)
    for _ in range(max_iters):
        rw = Rewriter(g, max_per_node=max_per_node)
        g2 = rw.run(table)
        if rw.fired == 0:
            return g
        g = g2
    return g
