"""Dynamo's per-call location headers, computed only when the logs that print them are on.

For every call it records into a graph, Dynamo builds a location header (``file:line in
code (function)``, ``InstructionTranslatorBase.get_line_of_code_header``) whether or not the
debug logs that print it (the ``trace_call`` and ``trace_source`` artifacts) are enabled.  The
function name comes from ``torch._dynamo.funcname_cache.get_funcname``, which tokenizes each
source file it is asked about, whole, the first time: ``torch/nn/modules/module.py``, the
model's files, ``torch/optim/optimizer.py``... in every process that compiles.  Measured in the
warm first step of bench workloads (a new process, caches filled, 1 thread, 2026-12-03): 0.17 s
for the MLP (4 files), 0.23 s for Llama (11), 0.36 s for GPT-2 (13); the MLP's first step was
1.49 s.  Nothing else reads that name: the header goes only into those two logs.

:func:`install` wraps the name as Dynamo's tracer imported it: when either log would emit a
debug record, torch's function answers (the same header, the same log text); otherwise the
header is built without the function name and nothing is tokenized.  Like
:mod:`kiln.frontends.compile.optimizer_trace`, it goes in only over the function it was checked
against (torch 2.13, the name still torch's own), when Kiln's backend first runs and when
``kiln.compile`` is called, not at ``import kiln``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

# torch releases whose header builder was read: get_funcname feeds only the trace_call /
# trace_source debug logs (symbolic_convert.get_line_of_code_header and its callers)
_CHECKED = ("2.13.",)
_NAME = "get_funcname"


def _wrap(
    original: Callable[[str, int], str | None], logs: tuple[logging.Logger, ...]
) -> Callable[[str, int], str | None]:
    @functools.wraps(original)
    def get_funcname(filename: str, lineno: int) -> str | None:
        if any(log.isEnabledFor(logging.DEBUG) for log in logs):
            return original(filename, lineno)
        return None  # no log prints the header: skip tokenizing the file

    get_funcname.__kiln_wrapped__ = original  # type: ignore[attr-defined]
    return get_funcname


def install() -> bool:
    """Install the wrapper (once per process); whether it is in place."""
    if not torch.__version__.startswith(_CHECKED):
        return False
    from torch._dynamo import funcname_cache, symbolic_convert

    current = getattr(symbolic_convert, _NAME, None)
    if current is None:
        return False
    if hasattr(current, "__kiln_wrapped__"):
        return True
    if current is not getattr(funcname_cache, _NAME, None):
        return False  # someone else replaced it: leave theirs
    logs = tuple(
        getattr(symbolic_convert, name, None) for name in ("trace_call_log", "trace_source_log")
    )
    if not all(isinstance(log, logging.Logger) for log in logs):
        return False
    setattr(symbolic_convert, _NAME, _wrap(current, logs))
    return True
