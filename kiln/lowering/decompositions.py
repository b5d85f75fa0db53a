"""Kiln's own decompositions, for ops whose torch decomposition computes other numbers than
ATen's CPU kernel in bfloat16 / float16.

Both frontends decompose with torch's table (``torch._decomp``); these entries take precedence.
Kiln's kernels round a bf16 / fp16 op's result once, as eager rounds every op a user writes, so a
decomposition spelled out in the input's dtype rounds between its parts, where ATen's kernel
computes the whole op in float and rounds once.  Measured 2026-12-03 on 8,192 elements, bf16 /
fp16, elements off eager's before (both modes unless noted):

  native_dropout_backward  1,166 / 1,200  torch scales the mask first (``mask * scale`` rounds
                           1/0.9 to 1.109375); ATen computes ``grad * mask * scale``, the scale in
                           float: spelled out in ATen's order (a ``mul`` by a number keeps it in
                           float, kiln/codegen/cpp/scalars.py)
  softshrink               1,584 / 712    ATen computes ``x - lambd`` in float, lambd unrounded:
                           torch's decomposition run on float32 copies of the bf16 / fp16
                           arguments, the result rounded once (``_in_float``); in float32 it is
                           torch's decomposition as it is

  native_batch_norm_backward, native_group_norm_backward
                           (bf16 / fp16 input): kept whole, not decomposed.  ATen's CPU forward
                           kernels return their saved mean and inverse std in float32 when the
                           input is bf16 / fp16 and a weight, bias or running statistic is float32
                           (what autocast gives a norm after a convolution), where torch's meta
                           functions, and so the traced graphs, say the input's dtype; torch's
                           decomposition of the backward then read float32 memory as bf16
                           (garbage gradients, NaN after one step).  ATen's backward kernel takes
                           the statistics as its forward made them, as in eager.  Also kept whole
                           for a channels-last input: ATen's kernel reads it as stored, where the
                           decomposition's per-channel broadcasts made Kiln's kernels copy every
                           operand to contiguous (README: channels-last convolutional nets).

Not here: ``logit``, ``logit_backward``, ``special_entr``, ``xlogy``, ``xlog1py`` are 2,100-2,700
elements off eager in bf16 / fp16 too, but their ATen kernels round inside (``c10::BFloat16``
arithmetic and math functions), so neither torch's decomposition nor the op computed in float
(eager's own float32 kernel rounded: the same counts off) is eager's; each would need its kernel's
own sequence of roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten
_REDUCED = (torch.bfloat16, torch.float16)


def _dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """ATen's ``native_dropout_backward``: ``grad * mask * scale``."""
    return grad * mask * scale


def _in_float(decomp: Callable[..., Any]) -> Callable[..., Any]:
    """``decomp`` run on float32 copies of its bf16 / fp16 tensor arguments, the result rounded
    back to their dtype once (as ATen's kernel computes such an op in float)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        low = next(
            (a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in _REDUCED), None
        )
        if low is None:
            return decomp(*args, **kwargs)
        up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == low else a for a in args]
        return decomp(*up, **kwargs).to(low)

    return run


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    )


def _kept_for_reduced_input(decomp: Callable[..., Any]) -> Callable[..., Any]:
    """``decomp``, declined (``NotImplemented``: the traced graph keeps the ATen op) where the
    op's input (argument 1 of the norm backwards) is bf16 / fp16 or channels-last."""

    def run(*args: Any, **kwargs: Any) -> Any:
        x = args[1] if len(args) > 1 else kwargs.get("input")
        if isinstance(x, torch.Tensor) and (x.dtype in _REDUCED or _channels_last(x)):
            return NotImplemented
        return decomp(*args, **kwargs)

    return run


# Norm backwards whose saved statistics may be float32 where the graph says the input's dtype
_STATS_READERS = (aten.native_batch_norm_backward.default, aten.native_group_norm_backward.default)


def _table() -> dict[Any, Callable[..., Any]]:
    torch_table = core_aten_decompositions()
    own: dict[Any, Callable[..., Any]] = {aten.native_dropout_backward.default: _dropout_backward}
    for name in aten.softshrink.overloads():
        op = getattr(aten.softshrink, name)
        if op in torch_table:
            own[op] = _in_float(torch_table[op])
    for op in _STATS_READERS:
        own[op] = _kept_for_reduced_input(torch_table[op])
    return own


# op overload -> Kiln's decomposition; looked up before torch's
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _table()
