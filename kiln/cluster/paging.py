"""``maxResults``/``nextToken`` paging shared by the List* actions."""

from __future__ import annotations

import json
from typing import Any

from kiln.cluster.errors import InvalidParameterException


def paginate(items: list[Any], body: dict[str, Any], key: str) -> dict[str, Any]:
    """``maxResults``/``nextToken`` paging with an opaque offset token."""
    start = 0
    if body.get("nextToken"):
        try:
            start = json.loads(body["nextToken"])["offset"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise InvalidParameterException("invalid nextToken") from e
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidParameterException("invalid nextToken")
    limit = body.get("maxResults") or 100
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
        raise InvalidParameterException("maxResults must be a whole number from 1 to 100")
    page = items[start : start + limit]
    out: dict[str, Any] = {key: page}
    if start + limit < len(items):
        out["nextToken"] = json.dumps({"offset": start + limit})
    return out
