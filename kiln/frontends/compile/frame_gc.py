"""Dynamo's compile of a Kiln frame with CPython's cyclic garbage collector paused.

Tracing a frame allocates hundreds of thousands of objects (variable trackers, FX nodes, fake
tensors, guards) that live until the frame's compile ends; CPython's collector answers with young
collections every 700 allocations and, as survivors pile up, full collections over every object
of the process (torch, transformers, the model).  Measured with ``gc.callbacks`` over a warm first
step of the bench workloads (1 thread, 2026-12-03): 0.17 s on Llama (170 young, 19 middle and
one full collection), 0.07 s on GPT-2 and BERT, of 1.7-2.6 s.  The backend call already ran with
the collector off (:func:`cyclic_gc_paused`: AOTAutograd's tracing and Kiln's compile had two
full collections over the process's ~400-540k objects, ~0.25 s each, in the backend calls of
GPT-2's and BERT's cold first step); :func:`install` extends that to the whole frame compile
(Dynamo's ``convert_frame._compile``: tracing, guards, the backend call) when the frame's
compiler is Kiln's backend (``is_ours``).

Nothing is freed differently: reference counting goes on, the collector is switched back on
when the compile returns (or raises) only if it was on before (a program that turned it off
keeps it off; a nested compile finds it off and leaves it so), and cyclic garbage made meanwhile
is collected by the next collection after the compile.  Installed with the other trace wrappers
(``backend._install_trace_wrappers``), only over torch 2.13's own ``_compile``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

from kiln.frontends.compile.torch_wrap import defined_in, release_checked, wrap_once

_COMPILER_FN_POSITION = 5  # code, globals, locals, builtins, closure, compiler_fn, ...


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """CPython's cyclic garbage collector off for the length of the block, back on after it (if
    it was on: a program that turned it off keeps it off; a nested block finds it off and leaves
    it so).  Nothing is freed differently: reference counting goes on as usual, and cyclic
    garbage made meanwhile is collected by the next collection after the block."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _wrap(original: Callable[..., Any], is_ours: Callable[[Any], bool]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        compiler_fn = (
            args[_COMPILER_FN_POSITION]
            if len(args) > _COMPILER_FN_POSITION
            else kwargs.get("compiler_fn")
        )
        if not is_ours(compiler_fn):
            return original(*args, **kwargs)
        with cyclic_gc_paused():
            return original(*args, **kwargs)

    return _compile


def install(is_ours: Callable[[Any], bool]) -> bool:
    """Wrap ``convert_frame._compile`` (once per process); whether it is in place."""
    if not release_checked():
        return False
    from torch._dynamo import convert_frame

    def torchs(fn: Any) -> bool:  # torch's own, with the signature this was written against
        code = getattr(fn, "__code__", None)
        return (
            defined_in(convert_frame.__name__)(fn)
            and code is not None
            and code.co_varnames[_COMPILER_FN_POSITION : _COMPILER_FN_POSITION + 1]
            == ("compiler_fn",)
        )

    return wrap_once(convert_frame, "_compile", lambda fn: _wrap(fn, is_ours), torchs)
