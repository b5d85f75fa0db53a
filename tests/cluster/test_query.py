"""Cluster query language: evaluation tables, parse errors and constraint validation."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kiln.cluster.errors import InvalidParameterException
from kiln.cluster.query import parse, validate_constraints

TRN1 = {
    "attribute:ecs.instance-type": "trn1.32xlarge",
    "attribute:ecs.availability-zone": "us-east-1a",
    "attribute:ecs.os-type": "linux",
    "attribute:stack": "prod",
    "attribute:neuron.cores": "32",
    "ec2InstanceId": "i-0abc",
    "agentConnected": True,
    "agentVersion": "1.10.2",
    "runningTasksCount": 3,
    "registeredAt": datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
    "task:group": {"service:web", "family:train"},
}

# (expression, expected on TRN1)
EVALUATIONS: list[tuple[str, bool]] = [
    ("attribute:ecs.instance-type == trn1.32xlarge", True),
    ("attribute:ecs.instance-type equals trn1.32xlarge", True),
    ("attribute:ecs.instance-type == 'trn1.32xlarge'", True),
    ('attribute:ecs.instance-type == "inf2.xlarge"', False),
    ("attribute:ecs.instance-type != inf2.xlarge", True),
    ("attribute:ecs.instance-type =~ trn1.*", True),
    ("attribute:ecs.instance-type =~ inf.*", False),
    ("attribute:ecs.instance-type !~ inf.*", True),
    ("attribute:ecs.instance-type matches trn1", False),  # whole value must match
    ("attribute:ecs.instance-type in (trn1.32xlarge, trn1n.32xlarge)", True),
    ("attribute:ecs.instance-type in [inf2.xlarge, inf2.8xlarge]", False),
    ("attribute:ecs.instance-type not_in [inf2.xlarge]", True),
    (
        "attribute:ecs.availability-zone in [us-east-1a, us-east-1b] and attribute:stack == prod",
        True,
    ),
    ("attribute:stack == dev or attribute:ecs.os-type == linux", True),
    ("attribute:stack == dev && attribute:ecs.os-type == linux", False),
    ("attribute:stack == dev || attribute:ecs.os-type == linux", True),
    ("(attribute:stack == dev or attribute:stack == prod) and runningTasksCount < 4", True),
    ("attribute:stack == dev or attribute:stack == prod and runningTasksCount > 4", False),
    ("not(attribute:stack == prod)", False),
    ("NOT (attribute:stack == dev)", True),
    ("attribute:neuron.cores >= 32", True),
    ("attribute:neuron.cores > 100", False),  # numeric, not lexicographic
    ("runningTasksCount == 3", True),
    ("runningTasksCount <= 2", False),
    ("agentConnected == true", True),
    ("agentConnected == false", False),
    ("agentVersion >= 1.9.0", True),  # version order, not string order
    ("agentVersion < 1.10.10", True),
    ("ec2InstanceId in ['i-0abc', 'i-0def']", True),
    ("registeredAt > 2024-01-01", True),
    ("registeredAt < 2024-05-01T11:00:00Z", False),
    ("task:group == service:web", True),
    ("task:group != service:web", False),
    ("task:group in [service:db, family:train]", True),
    ("task:group not_in [service:db]", True),
    ("task:group =~ service:.*", True),
    ("not(task:group == database)", True),
    ("attribute:stack exists", True),
    ("attribute:stack !exists", False),
    # A missing attribute never matches, except under the negative operators.
    ("attribute:missing == x", False),
    ("attribute:missing =~ .*", False),
    ("attribute:missing in [x]", False),
    ("attribute:missing > 1", False),
    ("attribute:missing != x", True),
    ("attribute:missing not_in [x]", True),
    ("attribute:missing !~ x", True),
    ("attribute:missing not_exists", True),
    ("attribute:missing exists", False),
]


@pytest.mark.parametrize(("expression", "expected"), EVALUATIONS)
def test_evaluate(expression: str, expected: bool) -> None:
    assert parse(expression).evaluate(TRN1) is expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("task:group == service:web", False),
        ("task:group != service:web", True),
        ("task:group not_in [service:web]", True),
        ("runningTasksCount == 0", False),
        ("registeredAt > 2000-01-01", False),
    ],
)
def test_empty_instance(expression: str, expected: bool) -> None:
    assert parse(expression).evaluate({}) is expected


def test_registered_at_accepts_epoch_and_naive_datetimes() -> None:
    expr = parse("registeredAt >= 2024-05-01T12:00:00Z")
    assert expr.evaluate({"registeredAt": datetime(2024, 5, 1, 12, 0)})
    assert expr.evaluate({"registeredAt": datetime(2024, 5, 1, 12, 0, tzinfo=UTC).timestamp()})
    assert not expr.evaluate({"registeredAt": "2024-04-30T00:00:00+00:00"})


def _at(position: int, reason: str, expression: str) -> str:
    return (
        f"invalid memberOf expression at position {position}: {reason} (expression: {expression!r})"
    )


SUBJECT_LIST = (
    "agentConnected, agentVersion, attribute:<name>, ec2InstanceId, registeredAt,"
    " runningTasksCount, task:group"
)
OPERATORS = "==, !=, >, >=, <, <=, in, not_in, =~, !~, exists, !exists"

# (expression, position, reason)
PARSE_ERRORS: list[tuple[str, int, str]] = [
    ("", 1, "the expression is empty; write e.g. attribute:ecs.instance-type == trn1.32xlarge"),
    ("instanceType == x", 1, f"unknown subject 'instanceType'; use one of {SUBJECT_LIST}"),
    (
        "attribute: == x",
        1,
        "attribute name missing after 'attribute:'; write e.g. attribute:ecs.instance-type",
    ),
    ("== x", 1, f"expected a subject ({SUBJECT_LIST}), got '=='"),
    (
        "attribute:a",
        12,
        f"expected an operator ({OPERATORS}) after 'attribute:a', got the end of the expression",
    ),
    ("attribute:a is x", 13, f"expected an operator ({OPERATORS}) after 'attribute:a', got 'is'"),
    ("attribute:a == ", 16, "expected a value after the operator, got the end of the expression"),
    ("attribute:a in x", 16, "expected a list such as [a, b] after 'in'/'not_in', got 'x'"),
    (
        "attribute:a in [x, y",
        21,
        "expected ']' to close the '[' at position 16, got the end of the expression",
    ),
    ("attribute:a in [x, ]", 20, "expected a value after the operator, got ']'"),
    (
        "(attribute:a == x",
        18,
        "expected ')' to close the '(' at position 1, got the end of the expression",
    ),
    ("attribute:a == x)", 17, "expected 'and', 'or' or the end of the expression, got ')'"),
    (
        "attribute:a == x attribute:b == y",
        18,
        "expected 'and', 'or' or the end of the expression, got 'attribute:b'",
    ),
    (
        "attribute:a == x and",
        21,
        f"expected a subject ({SUBJECT_LIST}), got the end of the expression",
    ),
    (
        "not attribute:a == x",
        5,
        "expected '(' after 'not', got 'attribute:a'; write not(<expression>)",
    ),
    ("attribute:a == 'x", 16, "unterminated quoted value; close it with '"),
    ("attribute:a == x & y", 18, "unexpected character '&'"),
    (
        "attribute:a =~ '[unclosed'",
        16,
        "invalid regular expression '[unclosed' (missing ]: [unclosed; RE2 syntax: no backreferences or lookaround)",
    ),
    ("runningTasksCount > many", 21, "runningTasksCount compares with a whole number, got 'many'"),
    ("agentConnected == yes", 19, "agentConnected compares with true or false, got 'yes'"),
    (
        "registeredAt > yesterday",
        16,
        "registeredAt compares with a date such as 2024-01-31T00:00:00Z, got 'yesterday'",
    ),
    (
        "task:group > a",
        14,
        "task:group supports ==, !=, in, not_in, =~, !~, exists and !exists, not '>'",
    ),
]


@pytest.mark.parametrize(("expression", "position", "reason"), PARSE_ERRORS)
def test_parse_errors(expression: str, position: int, reason: str) -> None:
    with pytest.raises(InvalidParameterException) as caught:
        parse(expression)
    assert caught.value.message == _at(position, reason, expression)


def test_parse_rejects_non_string() -> None:
    with pytest.raises(InvalidParameterException) as caught:
        parse(42)  # type: ignore[arg-type]
    assert caught.value.message == "memberOf expression must be a string, got int"


MEMBER_OF = {"type": "memberOf", "expression": "attribute:ecs.instance-type == trn1.32xlarge"}

# (constraints, for_task_definition, exact message)
CONSTRAINT_ERRORS: list[tuple[Any, bool, str]] = [
    ({"type": "memberOf"}, False, "placementConstraints: expected a list of constraints, got dict"),
    (
        [MEMBER_OF] * 11,
        False,
        (
            "placementConstraints: at most 10 constraints are allowed per task (got 11); remove some"
            " or merge memberOf expressions with 'and'"
        ),
    ),
    (
        ["memberOf"],
        False,
        "placementConstraints[0]: expected an object with 'type' and 'expression', got str",
    ),
    (
        [{**MEMBER_OF, "field": "x"}],
        False,
        "placementConstraints[0]: unknown field 'field'; a constraint has only 'type' and 'expression'",
    ),
    (
        [{"expression": "attribute:a == b"}],
        False,
        "placementConstraints[0]: missing required field 'type'; use one of distinctInstance, memberOf",
    ),
    (
        [{"expression": "attribute:a == b"}],
        True,
        "placementConstraints[0]: missing required field 'type'; use one of memberOf",
    ),
    (
        [{"type": "spread"}],
        False,
        "placementConstraints[0]: invalid type 'spread'; use one of distinctInstance, memberOf",
    ),
    (
        [MEMBER_OF, {"type": "distinctInstance"}],
        True,
        (
            "placementConstraints[1]: distinctInstance is not allowed in a task definition; pass it to"
            " RunTask or CreateService instead, or use memberOf"
        ),
    ),
    (
        [{"type": "distinctInstance", "expression": "attribute:a == b"}],
        False,
        "placementConstraints[0]: distinctInstance takes no expression; remove 'expression'",
    ),
    (
        [{"type": "memberOf"}],
        False,
        (
            "placementConstraints[0]: memberOf requires an expression, e.g."
            " 'attribute:ecs.instance-type == trn1.32xlarge'"
        ),
    ),
    (
        [{"type": "memberOf", "expression": "  "}],
        False,
        (
            "placementConstraints[0]: memberOf requires an expression, e.g."
            " 'attribute:ecs.instance-type == trn1.32xlarge'"
        ),
    ),
    (
        [{"type": "memberOf", "expression": "attribute:a in [" + "x," * 1000 + "y]"}],
        False,
        "placementConstraints[0]: expression is 2018 characters long; the limit is 2000, shorten it",
    ),
    (
        [{"type": "memberOf", "expression": "attribute:a === b"}],
        False,
        (
            "placementConstraints[0]: invalid memberOf expression at position 15: unexpected"
            " character '=' (expression: 'attribute:a === b')"
        ),
    ),
]


@pytest.mark.parametrize(("constraints", "for_task_definition", "message"), CONSTRAINT_ERRORS)
def test_constraint_errors(constraints: Any, for_task_definition: bool, message: str) -> None:
    with pytest.raises(InvalidParameterException) as caught:
        validate_constraints(constraints, for_task_definition=for_task_definition)
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("constraints", "for_task_definition"),
    [
        (None, True),
        ([], True),
        ([MEMBER_OF] * 10, True),
        ([MEMBER_OF, {"type": "distinctInstance"}], False),
        ([{"type": "distinctInstance", "expression": None}], False),
        ([{"type": "memberOf", "expression": "attribute:a in [" + "x," * 990 + "y]"}], False),
    ],
)
def test_valid_constraints(constraints: Any, for_task_definition: bool) -> None:
    validate_constraints(constraints, for_task_definition=for_task_definition)


def test_backtracking_pattern_runs_in_linear_time():
    import time

    expr = parse("attribute:name =~ '(a|aa)+'")
    began = time.monotonic()
    assert not expr.evaluate({"attribute:name": "a" * 5000 + "b"})
    assert time.monotonic() - began < 1.0  # Python's re takes seconds here (issue 15 #6)


def test_deep_nesting_is_a_clear_error():
    with pytest.raises(InvalidParameterException, match="nests deeper"):
        parse("(" * 600 + "agentConnected == true" + ")" * 600)
    with pytest.raises(InvalidParameterException, match="nests deeper"):
        parse("not(" * 300 + "agentConnected == true" + ")" * 300)
