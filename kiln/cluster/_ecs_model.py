"""Access to the container service's API model as shipped with botocore.

The shapes (field names, enums, required members) are read at import time from botocore's
``data/ecs/2014-11-13/service-2.json(.gz)`` so that Kiln's notion of "a valid field" follows the
real service model instead of a hand-copied list. When botocore is not installed, ``SHAPES`` is
empty and ``check_shape`` does nothing (install boto3/botocore for full validation).
"""

from __future__ import annotations

import difflib
import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

from kiln.cluster.errors import ClientException

_MODEL_DIR = Path("data") / "ecs" / "2014-11-13"


def _load_model() -> dict[str, Any]:
    spec = importlib.util.find_spec("botocore")
    if spec is None or not spec.submodule_search_locations:
        return {}
    for location in spec.submodule_search_locations:
        base = Path(location) / _MODEL_DIR
        plain = base / "service-2.json"
        if plain.is_file():
            return json.loads(plain.read_text(encoding="utf-8"))
        packed = base / "service-2.json.gz"
        if packed.is_file():
            with gzip.open(packed, "rt", encoding="utf-8") as handle:
                return json.load(handle)
    return {}


_MODEL = _load_model()
SHAPES: dict[str, dict[str, Any]] = _MODEL.get("shapes", {})
OPERATIONS: dict[str, dict[str, Any]] = _MODEL.get("operations", {})
AVAILABLE: bool = bool(SHAPES)


def input_shape(action: str) -> str | None:
    """The model's input shape name of ``action`` (None when unknown or the model is missing)."""
    op = OPERATIONS.get(action)
    return op.get("input", {}).get("shape") if op else None


def shape(name: str) -> dict[str, Any] | None:
    """The model's definition of shape ``name`` (None when unknown or the model is missing)."""
    return SHAPES.get(name)


def member_names(shape_name: str) -> list[str]:
    """Member names of a structure shape, in model order ([] when the model is missing)."""
    found = SHAPES.get(shape_name)
    if not found:
        return []
    return list(found.get("members", {}))


def enum_values(shape_name: str) -> list[str]:
    """Enum values of a string shape ([] when it has none or the model is missing)."""
    found = SHAPES.get(shape_name)
    if not found:
        return []
    return list(found.get("enum", []))


_TYPE_NAMES = {
    "structure": "an object",
    "map": "an object",
    "list": "a list",
    "string": "a string",
    "integer": "an integer",
    "long": "an integer",
    "boolean": "true or false",
    "double": "a number",
    "float": "a number",
}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _type_ok(value: Any, kind: str) -> bool:
    if kind in ("structure", "map"):
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind in ("integer", "long"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind in ("double", "float"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True  # timestamp, blob: left to the caller


def _join(where: str, key: str) -> str:
    return key if where == "request" else f"{where}.{key}"


def _unknown_field(where: str, key: str, shape_name: str, members: list[str]) -> ClientException:
    lowered = {member.lower(): member for member in members}
    close = difflib.get_close_matches(key, members, n=1, cutoff=0.75)
    suggestion = lowered.get(key.lower()) or (close[0] if close else None)
    if suggestion is not None:
        fix = f"did you mean {suggestion!r}?"
    else:
        fix = f"valid fields are: {', '.join(members)}"
    return ClientException(f"{where}: unknown field {key!r} in {shape_name}; {fix}")


def check_shape(
    value: Any, shape_name: str, where: str, skip: frozenset[str] | set[str] = frozenset()
) -> None:
    """Check ``value`` against model shape ``shape_name``: known field names, JSON types, enums,
    required members and length limits. ``where`` is the path used in messages ("request" for the
    top level); ``skip`` names top-level members checked elsewhere. No-op without the model.
    Raises ClientException."""
    definition = SHAPES.get(shape_name)
    if definition is None:
        return
    kind = definition.get("type", "")
    if not _type_ok(value, kind):
        shown = "" if isinstance(value, (dict, list)) else f" {value!r}"
        raise ClientException(
            f"{where}: expected {_TYPE_NAMES.get(kind, kind)}, got {_kind(value)}{shown}"
        )
    if kind == "structure":
        members = definition.get("members", {})
        for key in value:
            if key not in members:
                raise _unknown_field(where, key, shape_name, list(members))
        for key in definition.get("required", []):
            if value.get(key) is None:
                raise ClientException(f"{where}: missing required field {key!r} in {shape_name}")
        for key, item in value.items():
            if key not in skip and item is not None:
                check_shape(item, members[key]["shape"], _join(where, key))
    elif kind == "list":
        _check_length(where, len(value), definition, "items")
        member = definition["member"]["shape"]
        for index, item in enumerate(value):
            check_shape(item, member, f"{where}[{index}]")
    elif kind == "map":
        for key, item in value.items():
            check_shape(key, definition["key"]["shape"], f"{where} key")
            check_shape(item, definition["value"]["shape"], f"{where}[{key!r}]")
    elif kind == "string":
        enum = definition.get("enum")
        if enum and value not in enum:
            raise ClientException(
                f"{where}: invalid value {value!r}; valid values are: {', '.join(enum)}"
            )
        _check_length(where, len(value), definition, "characters")
    elif kind in ("integer", "long"):
        low, high = definition.get("min"), definition.get("max")
        if low is not None and value < low:
            raise ClientException(f"{where}: must be at least {low} (got {value})")
        if high is not None and value > high:
            raise ClientException(f"{where}: must be at most {high} (got {value})")


def _check_length(where: str, size: int, definition: dict[str, Any], unit: str) -> None:
    low, high = definition.get("min"), definition.get("max")
    if low is not None and size < low:
        raise ClientException(f"{where}: must have at least {low} {unit} (got {size})")
    if high is not None and size > high:
        raise ClientException(f"{where}: must have at most {high} {unit} (got {size})")
