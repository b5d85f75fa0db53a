"""How Kiln puts a wrapper over one of torch's own functions: once, only over torch's own.

Every trace wrapper in this package (``log_only``, ``optimizer_trace``, ``logger_calls``,
``frame_gc``; ``known_breaks`` writes a dispatch table, but follows the same rules) was written
against torch's code as it is in the releases of :data:`CHECKED`.  :func:`wrap_once` installs one:

- on another torch release it changes nothing (the function may do something else there);
- a name already holding Kiln's wrapper (``__kiln_wrapped__``, the function it wraps) is left as
  it is: installing twice is a no-op;
- a name that no longer holds torch's own function (``is_torchs`` says no: a user or another
  library replaced it) is left to whoever replaced it.

It answers whether Kiln's wrapper is in place.  Nothing else here: what a wrapper does, and when
it defers to torch, is each module's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch releases whose wrapped functions were read
CHECKED = ("2.13.",)


def release_checked() -> bool:
    return torch.__version__.startswith(CHECKED)


def wrap_once(
    owner: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    is_torchs: Callable[[Any], bool],
) -> bool:
    """Set ``owner.name`` to ``make(current)`` unless it is done already or ``current`` is not
    torch's own; whether Kiln's wrapper is in place.  For a class, only an attribute the class
    itself defines counts (not one it inherits)."""
    if not release_checked():
        return False
    current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if current is None:
        return False
    if hasattr(current, "__kiln_wrapped__"):
        return True
    if not is_torchs(current):
        return False
    wrapper = make(current)
    wrapper.__kiln_wrapped__ = current  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return True


def defined_in(module_name: str) -> Callable[[Any], bool]:
    """``is_torchs`` for a function torch defines in ``module_name``."""
    return lambda fn: getattr(fn, "__module__", None) == module_name
