"""Kiln precision: bf16 training with stochastic rounding, fp8 formats with a configurable bias.

    KILN_STOCHASTIC_ROUNDING=1 python train.py     # every compiled fp32 -> bf16/fp16 cast is SR
    kiln.precision.manual_seed(0)                  # reproducible rounding bits

    from kiln.precision import quantize, dequantize, E4M3, Fp8Linear

Modules: ``formats`` (format type, E4M3/E5M2/fnuz/E3M4), ``cpp`` (the C++ rounding code the
generated kernels include), ``rounding`` (switch, seed, step counter), ``kernels`` / ``quant``
(standalone generated kernels and their Python API), ``aten_sr`` (SR for bf16 ops that run through
ATen), ``fp8_layers`` (drop-in fp8 training layers: ``Fp8Linear``, ``Fp8Conv1D``; the function
``fp8_linear``).  Names are imported on first use, so
the code generator can import the low-level modules without pulling in the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FloatFormat": "formats",
    "FormatError": "formats",
    "E4M3": "formats",
    "E5M2": "formats",
    "E4M3_FNUZ": "formats",
    "E5M2_FNUZ": "formats",
    "E3M4": "formats",
    "FP16": "formats",
    "FP8_FORMATS": "formats",
    "fp8_format": "formats",
    "manual_seed": "rounding",
    "stochastic_round": "quant",
    "round_nearest": "quant",
    "quantize": "quant",
    "dequantize": "quant",
    "Fp8Linear": "fp8_layers",
    "Fp8Conv1D": "fp8_layers",
    "fp8_linear": "fp8_layers",
    "convert_to_fp8": "fp8_layers",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'kiln.precision' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kiln.precision.{mod}"), name)
