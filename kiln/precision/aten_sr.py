"""Stochastic rounding for bf16 / fp16 ops that run through ATen instead of a generated kernel.

With ``KILN_STOCHASTIC_ROUNDING=1``, an elementwise node with a bf16 / fp16 result that the code
generator does not fuse (``_foreach_*`` optimizer updates on the lazy device, ops with list
arguments) is run on float32 copies of its low-precision inputs, and each float32 result is rounded
stochastically to the node's dtype by a generated cast kernel.  ATen computes these ops in float
internally and rounds once to nearest; this rounds the same float value stochastically instead.

Low level: imports only :mod:`kiln.ir` and :mod:`kiln.precision.rounding`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Node
from kiln.ir.ops import Category
from kiln.precision import rounding

LOWP = {torch.bfloat16: "bf16", torch.float16: "f16"}


def sr_wanted(n: Node) -> bool:
    """Stochastic rounding is on and ``n``, run through ATen, has bf16 / fp16 results."""
    return rounding.enabled() and wants_sr(n)


def wants_sr(n: Node) -> bool:
    """An ATen-run node whose low-precision results must be rounded stochastically."""
    if n.op in ("fused", "writeback", "getitem") or n.category != Category.ELEMENTWISE:
        return False
    return any(t is not None and t.dtype in LOWP for t in n.types)


def in_float(n: Node) -> Node:
    """``n`` computing its result in float32: a bf16 / fp16 ``dtype`` argument (a cast such as
    ``_to_copy``) becomes float32, so the stochastic rounding after it is the only rounding."""
    if n.kwarg("dtype") not in LOWP:
        return n
    kwargs = tuple((k, torch.float32 if k == "dtype" else v) for k, v in n.kwargs)
    return n.with_(kwargs=kwargs)


def _up(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.dtype in LOWP:
        return v.float()
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(_up(x) for x in v)
    return v


def sr_call(
    n: Node, call: Callable[[Sequence[Any]], Any], casts: dict[str, Callable]
) -> Callable[[Sequence[Any]], list]:
    """``ins -> [outputs]`` for node ``n`` (as a generated kernel's call returns them): ``call``
    (of :func:`in_float` ``(n)``) on float32 inputs, then every float32 result whose declared type is bf16 / fp16 rounded
    stochastically by ``casts[abbr](x_ptr, y_ptr, n, key)``."""
    want = [t.dtype if t is not None and t.dtype in LOWP else None for t in n.types]

    def down(v: Any, dt: torch.dtype | None) -> Any:
        if isinstance(v, (list, tuple)):  # a foreach op's list of results
            return type(v)(down(x, dt) for x in v)
        if dt is None or not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            return v
        x = v.contiguous()
        y = torch.empty(x.shape, dtype=dt)
        if x.numel():
            casts[LOWP[dt]](x.data_ptr(), y.data_ptr(), x.numel(), rounding.next_key())
        return y

    def run(ins: Sequence[Any]) -> list:
        out = call([_up(v) for v in ins])
        if len(want) == 1:  # one value (maybe a list of tensors): the executor takes [0]
            return [down(out, want[0])]
        return [down(v, dt) for v, dt in zip(out, want)]

    return run
