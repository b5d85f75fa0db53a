"""Access to the container service's API model as shipped with botocore.

The shapes (field names, enums, required members) are read at import time from botocore's
``data/ecs/2014-11-13/service-2.json(.gz)`` so that Kiln's notion of "a valid field" follows the
real service model instead of a hand-copied list. When botocore is not installed, ``SHAPES`` is
empty and callers skip the checks that need it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

_MODEL_DIR = Path("data") / "ecs" / "2014-11-13"


def _load_shapes() -> dict[str, dict[str, Any]]:
    spec = importlib.util.find_spec("botocore")
    if spec is None or not spec.submodule_search_locations:
        return {}
    for location in spec.submodule_search_locations:
        base = Path(location) / _MODEL_DIR
        plain = base / "service-2.json"
        if plain.is_file():
            return json.loads(plain.read_text(encoding="utf-8"))["shapes"]
        packed = base / "service-2.json.gz"
        if packed.is_file():
            with gzip.open(packed, "rt", encoding="utf-8") as handle:
                return json.load(handle)["shapes"]
    return {}


SHAPES: dict[str, dict[str, Any]] = _load_shapes()
AVAILABLE: bool = bool(SHAPES)


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
