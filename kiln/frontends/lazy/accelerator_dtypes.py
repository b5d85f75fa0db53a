"""Ops whose accelerator kernels take dtypes the CPU kernels do not, made to work on the kiln device.

Libraries branch on ``tensor.device.type``: on any device other than ``cpu`` they take the path
written for CUDA, which may call an ATen op with a dtype only CUDA's kernel accepts.  The kiln
device runs such an op with the CPU's kernel (its ATen fallback), which raises.  Each entry here
computes the op in a dtype the CPU takes and returns what the accelerator's kernel would:

    histc(int x) -> histc(x as float64) cast back to x's dtype.   transformers' mixture-of-experts
        layers count tokens per expert with ``histc`` of int32 expert ids off the CPU
        ("histogram_cpu" not implemented for 'Int').  Integers up to 2**53 are exact in float64,
        and ATen's CPU histogram computes a bin as (x - min) * bins / (max - min), as CUDA's
        integer kernel does, so every count is the same.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Any:
    if x.is_floating_point():
        return NotImplemented  # the CPU kernel takes it: recorded as it is
    return aten.histc.default(x.to(torch.float64), bins, min, max).to(x.dtype)


DECOMPOSITIONS: dict[Any, Any] = {
    aten.histc.default: histc,
}
