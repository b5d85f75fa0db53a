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
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from kiln.cluster.errors import InvalidParameterException

MAX_EXPRESSION_LENGTH = 2000
MAX_CONSTRAINTS = 10

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
_NEGATIVE = {"!=", "not_in", "!~", "!exists"}
_ORDERING = {">", ">=", "<", "<="}
_OPERATOR_LIST = "==, !=, >, >=, <, <=, in, not_in, =~, !~, exists, !exists"

_SYMBOLS = ("==", "!=", ">=", "<=", "=~", "!~", "&&", "||", ">", "<", "(", ")", "[", "]", ",")
_WORD_STOP = set(" \t\r\n()[],'\"=!<>&|")


@dataclass(frozen=True)
class Token:
    kind: str  # "symbol" | "word" | "string" | "end"
    text: str
    position: int  # 1-based column of the first character


def _error(expression: str, position: int, reason: str) -> InvalidParameterException:
    return InvalidParameterException(
        f"invalid memberOf expression at position {position}: {reason} (expression: {expression!r})"
    )


def _tokenize(expression: str) -> list[Token]:
    tokens: list[Token] = []
    index = 0
    while index < len(expression):
        char = expression[index]
        if char.isspace():
            index += 1
            continue
        column = index + 1
        if char in "'\"":
            end = expression.find(char, index + 1)
            if end < 0:
                raise _error(expression, column, f"unterminated quoted value; close it with {char}")
            tokens.append(Token("string", expression[index + 1 : end], column))
            index = end + 1
            continue
        if expression.startswith("!exists", index):
            tokens.append(Token("word", "!exists", column))
            index += len("!exists")
            continue
        symbol = next((s for s in _SYMBOLS if expression.startswith(s, index)), None)
        if symbol is not None:
            tokens.append(Token("symbol", symbol, column))
            index += len(symbol)
            continue
        if char in _WORD_STOP:
            raise _error(expression, column, f"unexpected character {char!r}")
        end = index
        while end < len(expression) and expression[end] not in _WORD_STOP:
            end += 1
        tokens.append(Token("word", expression[index:end], column))
        index = end
    tokens.append(Token("end", "", len(expression) + 1))
    return tokens


class Expr:
    """A parsed expression; ``evaluate`` tells whether a container instance satisfies it."""

    def evaluate(self, subject: dict) -> bool:
        """``subject`` maps subject names to the instance's values, e.g.
        ``{"attribute:ecs.instance-type": "trn1.32xlarge", "ec2InstanceId": "i-1",
        "agentConnected": True, "agentVersion": "1.0.0", "runningTasksCount": 3,
        "registeredAt": datetime(...), "task:group": {"groupA"}}``."""
        raise NotImplementedError


@dataclass(frozen=True)
class And(Expr):
    left: Expr
    right: Expr

    def evaluate(self, subject: dict) -> bool:
        return self.left.evaluate(subject) and self.right.evaluate(subject)


@dataclass(frozen=True)
class Or(Expr):
    left: Expr
    right: Expr

    def evaluate(self, subject: dict) -> bool:
        return self.left.evaluate(subject) or self.right.evaluate(subject)


@dataclass(frozen=True)
class Not(Expr):
    operand: Expr

    def evaluate(self, subject: dict) -> bool:
        return not self.operand.evaluate(subject)


def _version_key(text: str) -> tuple[int, ...] | None:
    match = re.fullmatch(r"v?(\d+(?:\.\d+)*)", text.strip())
    if not match:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def _to_datetime(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, date):
        moment = datetime(value.year, value.month, value.day)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.fromtimestamp(value, tz=UTC)
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            return None
    else:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment


def _compare(left: Any, operator: str, right: Any) -> bool:
    if operator == "==":
        return left == right
    if operator == "!=":
        return left != right
    if operator == ">":
        return left > right
    if operator == ">=":
        return left >= right
    if operator == "<":
        return left < right
    return left <= right


@dataclass(frozen=True)
class Comparison(Expr):
    subject: str
    operator: str  # canonical symbol: ==, !=, >, >=, <, <=, in, not_in, =~, !~, exists, !exists
    values: tuple[str, ...]  # one value, a list for in/not_in, none for exists/!exists
    patterns: tuple[re.Pattern[str], ...] = ()

    def evaluate(self, subject: dict) -> bool:
        value = subject.get(self.subject)
        if self.subject == "task:group":
            groups = {str(v) for v in value} if value else set()
            present = bool(groups)
            candidates = sorted(groups)
        else:
            present = value is not None
            candidates = [value] if present else []
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if not present:
            return self.operator in _NEGATIVE
        if self.subject == "task:group":
            positive = _positive(self.operator)
            hit = any(self._test(c, positive) for c in candidates)
            return hit if positive == self.operator else not hit
        return self._test(value, self.operator)

    def _test(self, value: Any, operator: str) -> bool:
        if operator in ("=~", "!~"):
            hit = any(pattern.fullmatch(_as_text(value)) for pattern in self.patterns)
            return hit if operator == "=~" else not hit
        if operator in ("in", "not_in"):
            hit = any(_equal(value, v, self.subject) for v in self.values)
            return hit if operator == "in" else not hit
        left, right = _comparable(value, self.values[0], self.subject)
        if left is None or right is None:
            return operator == "!="
        try:
            return _compare(left, operator, right)
        except TypeError:
            return operator == "!="


def _positive(operator: str) -> str:
    return {"!=": "==", "not_in": "in", "!~": "=~"}.get(operator, operator)


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _equal(value: Any, argument: str, subject: str) -> bool:
    left, right = _comparable(value, argument, subject)
    return left is not None and left == right


def _comparable(value: Any, argument: str, subject: str) -> tuple[Any, Any]:
    """Both sides converted to a common type for the subject."""
    if subject == "agentConnected":
        return _as_text(value).lower(), argument.lower()
    if subject == "runningTasksCount":
        try:
            return int(value), int(argument)
        except (TypeError, ValueError):
            return None, None
    if subject == "registeredAt":
        return _to_datetime(value), _to_datetime(argument)
    if subject == "agentVersion":
        left, right = _version_key(_as_text(value)), _version_key(argument)
        if left is not None and right is not None:
            width = max(len(left), len(right))
            return left + (0,) * (width - len(left)), right + (0,) * (width - len(right))
        return _as_text(value), argument
    text = _as_text(value)
    try:
        return float(text), float(argument)
    except ValueError:
        return text, argument


class _Parser:
    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.tokens = _tokenize(expression)
        self.index = 0

    @property
    def current(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.tokens[self.index]
        self.index += 1
        return token

    def fail(self, reason: str, token: Token | None = None) -> InvalidParameterException:
        token = token or self.current
        return _error(self.expression, token.position, reason)

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
        patterns: tuple[re.Pattern[str], ...] = ()
        if operator in ("=~", "!~"):
            try:
                patterns = tuple(re.compile(v) for v in values)
            except re.error as exc:
                raise self.fail(
                    f"invalid regular expression {values[0]!r} ({exc})", start
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
                and _to_datetime(value) is None
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
