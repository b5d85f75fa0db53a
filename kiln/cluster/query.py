"""The cluster query language of ``memberOf`` placement constraints.

An expression is ``subject operator [argument]``, combined with ``and`` / ``or`` (also ``&&`` /
``||``), ``not(...)`` and parentheses. Subjects: ``agentConnected``, ``agentVersion``,
``attribute:<name>``, ``ec2InstanceId``, ``registeredAt``, ``runningTasksCount``, ``task:group``.
Operators: ``==`` (equals), ``!=`` (not_equals), ``>`` (greater_than), ``>=``
(greater_than_equal), ``<`` (less_than), ``<=`` (less_than_equal), ``in``, ``not_in``, ``=~``
(matches, a regular expression that must match the whole value), ``!~`` (not_matches),
``exists``, ``!exists`` (not_exists). Lists are written ``[a, b]`` or ``(a, b)``; values may be
bare words (``trn1.32xlarge``, ``trn1.*``) or quoted.

Evaluation takes a *subject* dict (see ``Expr.evaluate``). A subject that is missing never
matches, except under the negative operators ``!=``, ``not_in``, ``!~`` and ``!exists``.
"""

from __future__ import annotations

import re
from typing import Any

import re2

from kiln.cluster._query_ast import And, Comparison, Expr, Not, Or, to_datetime
from kiln.cluster._query_lex import Token, query_error, tokenize
from kiln.cluster.errors import InvalidParameterException

MAX_EXPRESSION_LENGTH = 2000
MAX_NESTING = 32  # parentheses and not(...) inside one another

# Regular expressions run on RE2: linear time in the input, so no pattern (``(a|aa)+``) can hold
# the placement lock for long.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False
MAX_CONSTRAINTS = 10

__all__ = ["And", "Comparison", "Expr", "Not", "Or", "parse", "validate_constraints"]

SUBJECTS = (
    "agentConnected",
    "agentVersion",
    "attribute:<name>",
    "ec2InstanceId",
    "registeredAt",
    "runningTasksCount",
    "task:group",
)
_PLAIN_SUBJECTS = {s for s in SUBJECTS if "<" not in s}

# Word and symbol spellings of each operator, mapped to its canonical symbol.
_OPERATORS: dict[str, str] = {
    "==": "==",
    "equals": "==",
    "!=": "!=",
    "not_equals": "!=",
    ">": ">",
    "greater_than": ">",
    ">=": ">=",
    "greater_than_equal": ">=",
    "<": "<",
    "less_than": "<",
    "<=": "<=",
    "less_than_equal": "<=",
    "in": "in",
    "not_in": "not_in",
    "=~": "=~",
    "matches": "=~",
    "!~": "!~",
    "not_matches": "!~",
    "exists": "exists",
    "!exists": "!exists",
    "not_exists": "!exists",
}
_ORDERING = {">", ">=", "<", "<="}
_OPERATOR_LIST = "==, !=, >, >=, <, <=, in, not_in, =~, !~, exists, !exists"


class _Parser:
    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.tokens = tokenize(expression)
        self.index = 0
        self.depth = 0

    @property
    def current(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def fail(self, reason: str, token: Token | None = None) -> InvalidParameterException:
        token = token or self.current
        return query_error(self.expression, token.position, reason)

    def describe(self, token: Token) -> str:
        return "the end of the expression" if token.kind == "end" else repr(token.text)

    def is_keyword(self, *words: str) -> bool:
        token = self.current
        if token.kind == "symbol":
            return token.text in words
        return token.kind == "word" and token.text.lower() in words

    def parse(self) -> Expr:
        if self.current.kind == "end":
            raise self.fail(
                "the expression is empty; write e.g. attribute:ecs.instance-type == trn1.32xlarge"
            )
        expr = self.parse_or()
        if self.current.kind != "end":
            raise self.fail(
                f"expected 'and', 'or' or the end of the expression, got {self.describe(self.current)}"
            )
        return expr

    def parse_or(self) -> Expr:
        expr = self.parse_and()
        while self.is_keyword("or", "||"):
            self.advance()
            expr = Or(expr, self.parse_and())
        return expr

    def parse_and(self) -> Expr:
        expr = self.parse_factor()
        while self.is_keyword("and", "&&"):
            self.advance()
            expr = And(expr, self.parse_factor())
        return expr

    def parse_factor(self) -> Expr:
        token = self.current
        if self.depth >= MAX_NESTING:
            raise self.fail(f"the expression nests deeper than {MAX_NESTING} levels")
        self.depth += 1
        try:
            return self._parse_factor(token)
        finally:
            self.depth -= 1

    def _parse_factor(self, token: Token) -> Expr:
        if token.kind == "symbol" and token.text == "(":
            self.advance()
            expr = self.parse_or()
            self.expect_close(")", token)
            return expr
        if token.kind == "word" and token.text.lower() == "not":
            self.advance()
            opening = self.current
            if not (opening.kind == "symbol" and opening.text == "("):
                raise self.fail(
                    f"expected '(' after 'not', got {self.describe(opening)}; write not(<expression>)"
                )
            self.advance()
            expr = self.parse_or()
            self.expect_close(")", opening)
            return Not(expr)
        return self.parse_comparison()

    def expect_close(self, closing: str, opening: Token) -> None:
        if not (self.current.kind == "symbol" and self.current.text == closing):
            raise self.fail(
                f"expected {closing!r} to close the {opening.text!r} at position {opening.position},"
                f" got {self.describe(self.current)}"
            )
        self.advance()

    def parse_subject(self) -> str:
        token = self.current
        if token.kind != "word":
            raise self.fail(
                f"expected a subject ({', '.join(SUBJECTS)}), got {self.describe(token)}"
            )
        name = token.text
        if name.startswith("attribute:"):
            if len(name) == len("attribute:"):
                raise self.fail(
                    "attribute name missing after 'attribute:'; write e.g. attribute:ecs.instance-type"
                )
        elif name not in _PLAIN_SUBJECTS:
            raise self.fail(f"unknown subject {name!r}; use one of {', '.join(SUBJECTS)}")
        self.advance()
        return name

    def parse_value(self, subject: str) -> str:
        token = self.current
        if token.kind not in ("word", "string"):
            raise self.fail(f"expected a value after the operator, got {self.describe(token)}")
        self.advance()
        return token.text

    def parse_list(self, subject: str) -> tuple[str, ...]:
        opening = self.current
        if not (opening.kind == "symbol" and opening.text in "(["):
            raise self.fail(
                f"expected a list such as [a, b] after 'in'/'not_in', got {self.describe(opening)}"
            )
        closing = ")" if opening.text == "(" else "]"
        self.advance()
        values = [self.parse_value(subject)]
        while self.current.kind == "symbol" and self.current.text == ",":
            self.advance()
            values.append(self.parse_value(subject))
        self.expect_close(closing, opening)
        return tuple(values)

    def parse_comparison(self) -> Expr:
        subject = self.parse_subject()
        token = self.current
        spelling = token.text if token.kind == "symbol" else token.text.lower()
        operator = _OPERATORS.get(spelling) if token.kind in ("word", "symbol") else None
        if operator is None:
            raise self.fail(
                f"expected an operator ({_OPERATOR_LIST}) after {subject!r}, got {self.describe(token)}"
            )
        self.advance()
        if operator in ("exists", "!exists"):
            return Comparison(subject, operator, ())
        start = self.current
        values = (
            self.parse_list(subject)
            if operator in ("in", "not_in")
            else (self.parse_value(subject),)
        )
        self.check_values(subject, operator, values, start)
        patterns: tuple[Any, ...] = ()
        if operator in ("=~", "!~"):
            try:
                patterns = tuple(re2.compile(v, _RE2_OPTIONS) for v in values)
            except re2.error as exc:
                detail = exc.args[0] if exc.args else exc
                if isinstance(detail, bytes):
                    detail = detail.decode("utf-8", "replace")
                raise self.fail(
                    f"invalid regular expression {values[0]!r} ({detail}; RE2 syntax: no"
                    " backreferences or lookaround)",
                    start,
                ) from None
        return Comparison(subject, operator, values, patterns)

    def check_values(
        self, subject: str, operator: str, values: tuple[str, ...], start: Token
    ) -> None:
        for value in values:
            if (
                subject == "runningTasksCount"
                and not re.fullmatch(r"\d+", value)
                and operator not in ("=~", "!~")
            ):
                raise self.fail(
                    f"runningTasksCount compares with a whole number, got {value!r}", start
                )
            if (
                subject == "agentConnected"
                and value.lower() not in ("true", "false")
                and operator not in ("=~", "!~")
            ):
                raise self.fail(f"agentConnected compares with true or false, got {value!r}", start)
            if (
                subject == "registeredAt"
                and operator not in ("=~", "!~")
                and to_datetime(value) is None
            ):
                raise self.fail(
                    f"registeredAt compares with a date such as 2024-01-31T00:00:00Z, got {value!r}",
                    start,
                )
        if subject == "task:group" and operator in _ORDERING:
            raise self.fail(
                f"task:group supports ==, !=, in, not_in, =~, !~, exists and !exists, not {operator!r}",
                start,
            )


def parse(expression: str) -> Expr:
    """Parse a cluster query expression; InvalidParameterException with position and reason."""
    if not isinstance(expression, str):
        raise InvalidParameterException(
            f"memberOf expression must be a string, got {type(expression).__name__}"
        )
    return _Parser(expression).parse()


def validate_constraints(constraints: list[dict], for_task_definition: bool) -> None:
    """Check placement constraints of a task definition or of RunTask/CreateService.

    ``memberOf`` needs an expression (at most 2000 characters, must parse); ``distinctInstance``
    takes none and is not allowed in task definitions; at most 10 constraints.
    """
    if constraints is None:
        return
    if not isinstance(constraints, list):
        raise InvalidParameterException(
            f"placementConstraints: expected a list of constraints, got {type(constraints).__name__}"
        )
    if len(constraints) > MAX_CONSTRAINTS:
        raise InvalidParameterException(
            f"placementConstraints: at most {MAX_CONSTRAINTS} constraints are allowed per task"
            f" (got {len(constraints)}); remove some or merge memberOf expressions with 'and'"
        )
    for index, constraint in enumerate(constraints):
        _validate_constraint(f"placementConstraints[{index}]", constraint, for_task_definition)


def _validate_constraint(where: str, constraint: Any, for_task_definition: bool) -> None:
    if not isinstance(constraint, dict):
        raise InvalidParameterException(
            f"{where}: expected an object with 'type' and 'expression', got {type(constraint).__name__}"
        )
    for key in constraint:
        if key not in ("type", "expression"):
            raise InvalidParameterException(
                f"{where}: unknown field {key!r}; a constraint has only 'type' and 'expression'"
            )
    kind = constraint.get("type")
    allowed = ("memberOf",) if for_task_definition else ("distinctInstance", "memberOf")
    if kind is None:
        raise InvalidParameterException(
            f"{where}: missing required field 'type'; use one of {', '.join(allowed)}"
        )
    if for_task_definition and kind == "distinctInstance":
        raise InvalidParameterException(
            f"{where}: distinctInstance is not allowed in a task definition; pass it to RunTask or"
            " CreateService instead, or use memberOf"
        )
    if kind not in allowed:
        raise InvalidParameterException(
            f"{where}: invalid type {kind!r}; use one of {', '.join(allowed)}"
        )
    expression = constraint.get("expression")
    if kind == "distinctInstance":
        if expression is not None:
            raise InvalidParameterException(
                f"{where}: distinctInstance takes no expression; remove 'expression'"
            )
        return
    if expression is None or (isinstance(expression, str) and not expression.strip()):
        raise InvalidParameterException(
            f"{where}: memberOf requires an expression, e.g. 'attribute:ecs.instance-type == trn1.32xlarge'"
        )
    if isinstance(expression, str) and len(expression) > MAX_EXPRESSION_LENGTH:
        raise InvalidParameterException(
            f"{where}: expression is {len(expression)} characters long; the limit is"
            f" {MAX_EXPRESSION_LENGTH}, shorten it"
        )
    try:
        parse(expression)
    except InvalidParameterException as exc:
        raise InvalidParameterException(f"{where}: {exc.message}") from None
