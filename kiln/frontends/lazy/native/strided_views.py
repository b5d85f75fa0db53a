"""``as_strided`` of a whole contiguous storage as the native recorder's table views.

The native recorder has no ``as_strided`` link: a computed value's buffer is laid out by the
graph, not necessarily in the strides its tensors claim, so replaying strides against the buffer
could read the wrong elements (record.h, ``reshape_alias_as_view``).  Such a call ran on the values
(a forced sync, counted as an ATen fallback): ATen's ``adaptive_avg_pool2d`` restrides its 1 x 1
result with ``as_strided_`` when its input looks channels-last (Swin's pooler, any
``adaptive_avg_pool1d`` of a transposed sequence), and ``as_strided``'s backward writes the
gradient through ``as_strided`` views of a flat buffer of zeros -- two syncs a step.

Where ``x`` is its storage's base tensor (no view chain), claims the contiguous row-major layout
from offset 0, and the call asks for a dense, non-overlapping layout of exactly ``x``'s elements
from offset 0, the storage's element order is ``x``'s logical order, so the call equals logical
views of ``x``'s value: a ``view`` to the asked dims sorted by stride, a ``permute`` back, an
``unsqueeze`` for each size-1 dim -- table views, whatever the buffer's physical layout.  (The
size-1 dims' strides are then unsqueeze's, not the asked ones: no element is addressed through
them.)  Every other call (a view's storage, an offset, overlapping or partial layouts) returns
None and runs as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.layout import dense_order


def as_strided_by_views(
    mod: Any,
    x: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> torch.Tensor | None:
    """``x.as_strided(size, stride, storage_offset)`` as table views of ``x``, or None where the
    module docstring's conditions do not hold."""
    if not all(isinstance(s, int) for s in (*size, *stride)) or len(size) != len(stride):
        return None
    if storage_offset not in (None, 0) or x.storage_offset() != 0 or not x.is_contiguous():
        return None
    n = x.numel()
    if n == 0:
        return None
    got = mod.view_chain(x)
    if got is None or got[1]:  # a storage shared with a view made on the values, or a view
        return None
    if mod.geo_of(got[0]) != mod.geo_of(x):  # (a base tensor has its storage's geometry)
        return None
    order = dense_order(size, stride)
    if order is None or math.prod(size) != n:  # a dense layout of exactly x's elements
        return None
    # the asked dims by stride, then back in their order (x is contiguous: any view of its size)
    y = x.view([size[i] for i in order]).permute(sorted(range(len(order)), key=order.__getitem__))
    for i, s in enumerate(size):
        if s == 1:
            y = y.unsqueeze(i)
    return y
