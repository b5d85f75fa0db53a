"""Work Dynamo does in every compile only for logs and metrics, skipped while no one records them.

Two pieces of Dynamo's frame compile in torch 2.13 cost a process's first step time and produce
only log text or a measured number:

- **Location headers.**  For every call it records into a graph, Dynamo builds a header
  (``file:line in code (function)``, ``InstructionTranslatorBase.get_line_of_code_header``)
  whether or not the debug logs that print it (the ``trace_call`` and ``trace_source``
  artifacts) are on.  The function name comes from ``funcname_cache.get_funcname``, which
  tokenizes each source file it is asked about, whole, the first time:
  ``torch/nn/modules/module.py``, the model's files, ``torch/optim/optimizer.py``...  Nothing
  else reads that name.
- **Guard latency.**  After building a frame's guards, Dynamo times one evaluation of them
  (``profile_guard_manager``) after flushing the CPU caches by writing a large buffer, ~20 ms a
  frame, for the ``guards`` debug log and the ``guard_latency_us`` compile metric.

Measured in the warm first step of bench workloads (a new process, caches filled,
``kiln.compile``, 1 thread, 2026-12-03): tokenizing took 0.17 s for the MLP (4 files), 0.23 s
for Llama (11), 0.36 s for GPT-2 (13), and the guard timing 0.10 s over the MLP's 5 frames; the
MLP's first step was 1.0-1.5 s.

:func:`install` wraps both names where Dynamo's modules look them up.  While a log that prints the
result is on (either trace log at DEBUG; the ``guards`` log at DEBUG or a structured trace,
``TORCH_TRACE``, for the latency), torch's function answers: the same log text, the same numbers.
Otherwise the header is built without the function name, and the latency is 0.0 -- torch's own
value for a frame whose guards it does not time (``skip_guards_check``) -- so
``guard_latency_us`` in ``torch._dynamo.utils.get_compilation_metrics()`` reads 0 while Kiln's
wrappers are installed and those logs are off.  The guards themselves are still built and checked
as before.  Each wrapper goes in only over the function it was checked against (torch 2.13, the
name still torch's own), when ``torch.compile`` looks up Kiln's backend by name (before Dynamo
traces anything: see ``backend._OnLookup``), when ``kiln.compile`` is called, and at the latest
when Kiln's backend first runs; not at ``import kiln``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kiln.frontends.compile.torch_wrap import release_checked, wrap_once

# in torch_wrap.CHECKED's releases, get_funcname feeds only the trace_call / trace_source
# headers; profile_guard_manager only the guards log and the guard_latency_us metric


def _debug_on(log: logging.Logger) -> bool:
    return log.isEnabledFor(logging.DEBUG)


def _trace_on(log: logging.Logger) -> bool:
    # torch's structured trace logger is always at DEBUG; it records when it has handlers
    return bool(log.handlers)


def _wrap(
    original: Callable[..., Any], wanted: Callable[[], bool], otherwise: Any
) -> Callable[..., Any]:
    """``original`` while ``wanted()``, else ``otherwise`` without calling it."""

    @functools.wraps(original)
    def wrapper(*args: Any) -> Any:
        if wanted():
            return original(*args)
        return otherwise

    return wrapper


def _install_one(
    user: ModuleType, name: str, owner: ModuleType, wanted: Callable[[], bool], otherwise: Any
) -> bool:
    """Wrap ``user.name`` (the name as ``user`` looks it up) if it is still ``owner``'s."""
    return wrap_once(
        user,
        name,
        lambda fn: _wrap(fn, wanted, otherwise),
        lambda fn: fn is getattr(owner, name, None),
    )


def install() -> bool:
    """Install both wrappers (once per process); whether both are in place."""
    if not release_checked():
        return False
    from torch._C._dynamo import guards as guards_c
    from torch._dynamo import funcname_cache, guards, symbolic_convert
    from torch._logging import _internal

    trace_logs = [
        getattr(symbolic_convert, n, None) for n in ("trace_call_log", "trace_source_log")
    ]
    guards_log = getattr(guards, "guards_log", None)
    structured = getattr(_internal, "trace_log", None)
    if not all(isinstance(x, logging.Logger) for x in (*trace_logs, guards_log, structured)):
        return False
    headers = _install_one(
        symbolic_convert,
        "get_funcname",
        funcname_cache,
        lambda: any(_debug_on(log) for log in trace_logs),
        None,
    )
    latency = _install_one(
        guards,
        "profile_guard_manager",
        guards_c,
        lambda: _debug_on(guards_log) or _trace_on(structured),
        0.0,
    )
    return headers and latency
