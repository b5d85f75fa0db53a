"""Functional ``_foreach_*`` ops as one op per list element, for compile mode.

A ``torch._foreach_*`` op applies one elementwise op to each tensor of its list arguments.  On
CPU, ATen runs it as that loop (its "slow path", ``ForeachOpsKernels.cpp``: ``t.add(scalar)`` for
each ``t``); in a compiled graph it stayed one ATen call per list, which Kiln cannot fuse: an
AdamW step with ``foreach=True`` ran its update as ~10 such calls over every parameter plus a
writeback per tensor (Llama, 21 parameters: 9.0 ms a step against 6.6 with the per-tensor loop
``foreach=False`` traces).  Spelled out as the per-element ops ATen's loop calls -- the same
ops with the same arguments, so the same numbers -- the graph's pointwise work fuses like the
per-tensor loop's, each parameter's update one kernel and same-shaped ones grouped.

Each entry maps a functional overload (what AOTAutograd's functionalization leaves of
``_foreach_mul_`` and friends) to the per-element op ATen's loop runs.  Not here: the
``Tensor`` overloads of ``addcdiv``/``addcmul`` (their per-element values come from a tensor's
data, read in ATen's loop), ``_foreach_norm`` (a reduction), and ops without a plain
per-element twin: those stay ATen calls, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

# foreach name -> the per-element op ATen's CPU loop calls (by overload name where it differs)
_TWIN: dict[str, Any] = {
    "add": aten.add,
    "sub": aten.sub,
    "mul": aten.mul,
    "div": aten.div,
    "addcdiv": aten.addcdiv,
    "addcmul": aten.addcmul,
    "lerp": aten.lerp,
    "pow": aten.pow,
    "clamp_min": aten.clamp_min,
    "clamp_max": aten.clamp_max,
    "sqrt": aten.sqrt,
    "rsqrt": aten.rsqrt,
    "neg": aten.neg,
    "abs": aten.abs,
    "exp": aten.exp,
    "log": aten.log,
    "sign": aten.sign,
    "reciprocal": aten.reciprocal,
    "copy": aten.copy,
    "zero": aten.zero,
}
# ATen's loop runs maximum/minimum with a number as clamp_min/clamp_max (no Scalar overload)
_SCALAR_TWIN = {"maximum": aten.clamp_min, "minimum": aten.clamp_max}
_LIST_TWIN = {"maximum": aten.maximum, "minimum": aten.minimum}
# arguments the per-element op takes by keyword where the foreach op takes them by position
_KEYWORD = {"addcdiv": {3: "value"}, "addcmul": {3: "value"}}
# overloads whose per-element values come from a tensor's data: left to ATen
_SKIP = {("addcdiv", "Tensor"), ("addcmul", "Tensor")}


def _per_element(name: str, twin: Any) -> Callable[..., list[torch.Tensor]]:
    keyword = _KEYWORD.get(name, {})

    def run(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        lists = [a for a in args if isinstance(a, list | tuple)]
        n = len(lists[0])
        out = []
        for i in range(n):
            pos, kw = [], {}
            for p, a in enumerate(args):
                v = a[i] if isinstance(a, list | tuple) else a
                if p in keyword:
                    kw[keyword[p]] = v
                else:
                    pos.append(v)
            for k, a in kwargs.items():
                kw[k] = a[i] if isinstance(a, list | tuple) else a
            out.append(twin(*pos, **kw))
        return out

    run.__name__ = f"foreach_{name}"
    return run


def _table() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}
    for name in (*_TWIN, *_SCALAR_TWIN):
        packet = getattr(aten, f"_foreach_{name}", None)
        if packet is None:
            continue
        for ovl in packet.overloads():
            if (name, ovl) in _SKIP or ovl == "out" or ovl.endswith("_out"):
                continue  # out= forms are not functional: functionalization rewrites them
            if name in _TWIN:
                twin = _TWIN[name]
            else:
                twin = _LIST_TWIN[name] if ovl == "List" else _SCALAR_TWIN[name]
            table[getattr(packet, ovl)] = _per_element(name, twin)
    return table


FOREACH_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _table()
