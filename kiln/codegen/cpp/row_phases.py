"""Phases of a rows kernel with an epilogue (:mod:`kiln.codegen.cpp.emit`).

A rows group (:mod:`kiln.passes.fuse`) holds, in body order, pointwise members computed in the
pass over the row that feeds its reductions, the reductions, and members that read them (the
epilogue): those that are one value per row, computed once after the reductions, and those that
vary along the row, computed in a second pass over it.  The epilogue re-evaluates the first-pass
values it reads (pure functions of the inputs) instead of keeping them in a row buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.codegen.cpp.ops import FORMULAS
from kiln.ir.graph import In
from kiln.ir.kernel import Val


def _vals_of(v: Any) -> list[int]:
    if isinstance(v, Val):
        return [v.i]
    if isinstance(v, (tuple, list)):
        return [i for x in v for i in _vals_of(x)]
    return []


def _ins_of(v: Any) -> list[int]:
    if isinstance(v, In):
        return [v.k]
    if isinstance(v, (tuple, list)):
        return [k for x in v for k in _ins_of(x)]
    return []


def _deps(entry: Any) -> list[int]:
    return _vals_of(entry[1]) + [i for _, v in entry[2] for i in _vals_of(v)]


def inputs_of(entries: list) -> set[int]:
    return {k for e in entries for k in _ins_of(e[1]) + [k for _, v in e[2] for k in _ins_of(v)]}


def closure(body: Any, targets: set[int], stop: set[int]) -> set[int]:
    """``targets`` and the body entries they read (transitively), short of ``stop``."""
    need: set[int] = set()
    todo = [b for b in targets if b not in stop]
    while todo:
        b = todo.pop()
        if b in need:
            continue
        need.add(b)
        todo.extend(d for d in _deps(body[b]) if d not in stop and d not in need)
    return need


@dataclass
class RowPhases:
    """A rows kernel's members by phase: ``pre`` (no reduction in their inputs: the first pass),
    ``after`` (they read a reduction, directly or not: the epilogue), ``scalar`` (the part of
    ``after`` that is one value per row: it reads no element that varies along the row)."""

    pre: set[int]
    after: set[int]
    scalar: set[int]


def row_phases(body: Any, modes: list[str], pos: dict[int, int]) -> RowPhases:
    """Classify a rows kernel's body; ``modes``: the tensor inputs' modes (``KernelSpec``),
    ``pos``: fused-node input -> position among the tensor inputs."""
    reds = {b for b, e in enumerate(body) if e[0] not in FORMULAS}
    after: set[int] = set()
    varies: dict[int, bool] = {}
    for b, e in enumerate(body):
        if b in reds:
            varies[b] = False
            continue
        ins = [k for k in _ins_of(e[1]) + [k for _, v in e[2] for k in _ins_of(v)] if k in pos]
        deps = _deps(e)
        varies[b] = any(modes[pos[k]] in ("full", "bcast_inner") for k in ins) or any(
            varies[d] for d in deps
        )
        if any(d in reds or d in after for d in deps):
            after.add(b)
    pre = {b for b in range(len(body)) if b not in reds and b not in after}
    return RowPhases(pre, after, {b for b in after if not varies[b]})
