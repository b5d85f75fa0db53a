"""Every request checked against the container service's model before any handler runs.

Types, enums, required members, string lengths and integer ranges come from botocore's model
(``kiln.cluster._ecs_model``); on top of it the limits the real service enforces but the model
does not spell out (at most 100 ids per Describe call, 10 for services).  What the model rejects
is a ``ClientException`` (HTTP 400) naming the field; nothing malformed reaches a handler.

Kiln's own extensions (``kilnDevices``/``kilnSimulated`` on RegisterContainerInstance) are
checked by their handler and are the only members the model does not know that pass.
"""

from __future__ import annotations

from typing import Any

from kiln.cluster import _ecs_model
from kiln.cluster.errors import ClientException, InvalidParameterException

# (action, member) -> most items the service accepts in one call.
LIST_CAPS = {
    ("DescribeTasks", "tasks"): 100,
    ("DescribeContainerInstances", "containerInstances"): 100,
    ("UpdateContainerInstancesState", "containerInstances"): 10,
    ("DescribeClusters", "clusters"): 100,
    ("DescribeServices", "services"): 10,
    ("TagResource", "tags"): 50,
    ("UntagResource", "tagKeys"): 50,
}
EXTENSIONS = {"RegisterContainerInstance": ("kilnDevices", "kilnSimulated")}
MAX_STRING = 64 * 1024  # a string member without a model limit (the body cap bounds the rest)


def validate_request(action: str, body: Any) -> dict[str, Any]:
    """Check ``body`` for ``action``; returns it (a dict) or raises a 400-class ECSError."""
    if not isinstance(body, dict):
        raise ClientException("the request body must be a JSON object")
    shape = _ecs_model.input_shape(action)
    if shape is None:
        raise ClientException(
            f"{action}: the service model is missing; install the cluster extra:"
            " pip install 'kiln[cluster]'"
        )
    extra = EXTENSIONS.get(action, ())
    _ecs_model.check_shape({k: v for k, v in body.items() if k not in extra}, shape, "request")
    for (name, member), cap in LIST_CAPS.items():
        if name == action and isinstance(body.get(member), list) and len(body[member]) > cap:
            raise InvalidParameterException(
                f"{member}: at most {cap} items per {action} call (got {len(body[member])})"
            )
    _check_strings(body, "request")
    return body


def _check_strings(value: Any, where: str) -> None:
    """No string longer than MAX_STRING and no NUL byte anywhere in the request."""
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ClientException(f"{where}: longer than {MAX_STRING} characters")
        if "\0" in value:
            raise ClientException(f"{where}: must not contain a NUL byte")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, f"{where} key")
            _check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_strings(item, f"{where}[{index}]")


__all__ = ["LIST_CAPS", "validate_request"]
