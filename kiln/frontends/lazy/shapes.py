"""Shape, dtype and stride inference for lazy ops, with a cache.

Each recorded op is first run on the meta device.  Meta kernels are often Python reference
implementations (tens of microseconds each), and a training loop repeats the same ops on the same
shapes every step, so results are cached by (op, argument signature).  Python floats do not enter
the signature of an op that has tensor arguments: they never change its output's shape.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kiln.ir.semantics import types_of

_FLOAT = object()
_cache: dict[tuple, Any] = {}
_MAX = 65536


class _Failed:
    """Cached: the op has no meta kernel or a data-dependent output shape.

    Keeps a copy of the exception without its traceback and raises a new copy each time: raising
    one exception object again adds the raising frames to its ``__traceback__``, and frames keep
    their callers' locals alive, so a cached exception re-raised every step (``.item()``'s meta
    kernel on a transformers step) kept every step's forward tensors alive."""

    def __init__(self, exc: Exception) -> None:
        self.exc = _bare(exc)

    def fresh(self) -> Exception:
        return _bare(self.exc)


def _bare(exc: Exception) -> Exception:
    """A copy of ``exc`` (its type, args and attributes) with no traceback, context or cause."""
    try:
        c = copy.copy(exc)
    except Exception:  # noqa: BLE001 - a type whose __init__ does not take its own args back
        c = type(exc).__new__(type(exc), *exc.args)
        c.args = exc.args
        c.__dict__.update(getattr(exc, "__dict__", {}))
    c.__traceback__ = None
    c.__context__ = c.__cause__ = None
    return c


def _sig(a: Any, has_tensor: bool) -> Any:
    t = type(a)
    if t is int:
        return a
    if t is float or t is bool or t is complex:
        # A top-level float beside a tensor never changes the output's shape or dtype.  Other
        # scalars keep their type: 6, 6.0, True and 6+0j are equal dictionary keys, but
        # ``arange(6)`` is int64 and ``arange(6.0)`` float32, ``full(s, True)`` bool.
        return _FLOAT if t is float and has_tensor else (t, a)
    if isinstance(a, torch.Tensor):
        m = getattr(a, "_meta", None)
        if m is not None:  # a lazy tensor (always on the kiln device): its meta says it all
            return (m.shape, m.stride(), m.storage_offset(), m.dtype)
        return (a.shape, a.stride(), a.storage_offset(), a.dtype, a.device.type)
    if isinstance(a, (list, tuple)):
        # floats in a list are kept (``upsample_*.vec``'s scale factors size the output)
        return tuple(_sig(x, False) for x in a)
    if isinstance(a, torch.device):
        return str(a)
    return a


def _spec(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return ("T", tuple(out.shape), out.stride(), out.dtype)
    if isinstance(out, (list, tuple)):
        return (type(out), tuple(_spec(o) for o in out))
    return ("V", out)


def _build(spec: Any) -> Any:
    if spec[0] == "T":
        return torch.empty_strided(spec[1], spec[2], dtype=spec[3], device="meta")
    if spec[0] == "V":
        return spec[1]
    return spec[0](_build(s) for s in spec[1])


def _has_tensor(args: tuple, kwargs: dict) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return True
    return any(isinstance(v, torch.Tensor) for v in kwargs.values())


def infer_typed(func: Any, args: tuple, kwargs: dict, to_meta: Any) -> tuple[Any, Any]:
    """``(output metas of func(*args, **kwargs), their Kiln types)``, cached together; raises
    what the meta kernel raised."""
    ht = _has_tensor(args, kwargs)
    try:
        key = (
            func,
            torch.get_default_dtype(),  # the dtype of factories, of int tensor * float, ...
            _sig(args, ht),
            _sig(tuple(sorted(kwargs.items())), ht),
        )
        hash(key)
    except TypeError:  # an unhashable argument (a Generator, ...): no caching
        key = None
    if key is not None:
        hit = _cache.get(key)
        if hit is not None:
            if isinstance(hit, _Failed):
                raise hit.fresh()
            return _build(hit[0]), hit[1]
    margs = tuple(_map(to_meta, a) for a in args)
    mkwargs = {k: _map(to_meta, v) for k, v in kwargs.items()}
    try:
        out = func(*margs, **mkwargs)
    except Exception as e:
        if key is not None and len(_cache) < _MAX:
            _cache[key] = _Failed(e)
        raise
    types = types_of(out)
    if key is not None and len(_cache) < _MAX:
        _cache[key] = (_spec(out), types)
    return out, types


def _map(fn: Any, a: Any) -> Any:
    if isinstance(a, list):
        return [_map(fn, x) for x in a]
    if isinstance(a, tuple):
        return tuple(_map(fn, x) for x in a)
    return fn(a)
