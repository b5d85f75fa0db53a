"""Dynamo's compile of a Kiln frame with CPython's cyclic garbage collector paused.

Tracing a frame allocates hundreds of thousands of objects (variable trackers, FX nodes, fake
tensors, guards) that live until the frame's compile ends; CPython's collector answers with young
collections every 700 allocations and, as survivors pile up, full collections over every object
of the process (torch, transformers, the model).  Measured with ``gc.callbacks`` over a warm first
step of the bench workloads (1 thread, 2026-12-03): 0.17 s on Llama (170 young, 19 middle and
one full collection), 0.07 s on GPT-2 and BERT, of 1.7-2.6 s.  The backend call already runs
with the collector off (``backend._cyclic_gc_paused``); :func:`install` extends that to the whole
frame compile (Dynamo's ``convert_frame._compile``: tracing, guards, the backend call) when the
frame's compiler is Kiln's backend (``is_ours``).

Nothing is freed differently: reference counting goes on, the collector is switched back on
when the compile returns (or raises) only if it was on before (a program that turned it off
keeps it off; a nested compile finds it off and leaves it so), and cyclic garbage made meanwhile
is collected by the next collection after the compile.  Installed with the other trace wrappers
(``backend._install_trace_wrappers``), only over torch 2.13's own ``_compile``.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch

_CHECKED = ("2.13.",)
_COMPILER_FN_POSITION = 5  # code, globals, locals, builtins, closure, compiler_fn, ...


def _wrap(original: Callable[..., Any], is_ours: Callable[[Any], bool]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        compiler_fn = (
            args[_COMPILER_FN_POSITION]
            if len(args) > _COMPILER_FN_POSITION
            else kwargs.get("compiler_fn")
        )
        if not gc.isenabled() or not is_ours(compiler_fn):
            return original(*args, **kwargs)
        gc.disable()
        try:
            return original(*args, **kwargs)
        finally:
            gc.enable()

    _compile.__kiln_wrapped__ = original  # type: ignore[attr-defined]
    return _compile


def install(is_ours: Callable[[Any], bool]) -> bool:
    """Wrap ``convert_frame._compile`` (once per process); whether it is in place."""
    if not torch.__version__.startswith(_CHECKED):
        return False
    from torch._dynamo import convert_frame

    current = getattr(convert_frame, "_compile", None)
    if current is None:
        return False
    if hasattr(current, "__kiln_wrapped__"):
        return True
    if getattr(current, "__module__", None) != convert_frame.__name__:
        return False  # someone else replaced it: leave theirs
    code = getattr(current, "__code__", None)
    if code is None or code.co_varnames[_COMPILER_FN_POSITION] != "compiler_fn":
        return False  # not the signature this was written against
    convert_frame._compile = _wrap(current, is_ours)
    return True
