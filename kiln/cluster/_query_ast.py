"""Expression tree and evaluation of the cluster query language (see ``kiln.cluster.query``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

NEGATIVE_OPERATORS = {"!=", "not_in", "!~", "!exists"}


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


def to_datetime(value: Any) -> datetime | None:
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
    patterns: tuple[Any, ...] = ()  # compiled RE2 patterns

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
            return self.operator in NEGATIVE_OPERATORS
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
        return to_datetime(value), to_datetime(argument)
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
