"""Python entry points: stochastic casts and fp8 quantize / dequantize on CPU tensors.

    y = stochastic_round(x)                        # fp32 -> bf16, unbiased
    codes = quantize(x, "e4m3", scale)             # uint8 codes (x * scale rounded to E4M3)
    x2 = dequantize(codes, "e4m3", scale)          # float32 (codes' values / scale)

Each runs one generated kernel (:mod:`kiln.precision.kernels`).  ``scale`` is a Python number, a
one-element tensor (per-tensor scaling) or one value per row of ``x.reshape(-1, x.shape[-1])``
(per-row scaling).
"""

from __future__ import annotations

import torch

from kiln.precision import kernels, rounding
from kiln.precision.formats import FloatFormat, fp8_format

_SR_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _check_cpu_float(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} expects a tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{what} runs on CPU tensors; got one on {x.device} (call .cpu() first)")
    if x.dtype != torch.float32:
        raise TypeError(f"{what} expects float32 input, got {x.dtype} (use .float() first)")
    return x.contiguous()


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, key: int | None = None
) -> torch.Tensor:
    """``x`` (float32) rounded stochastically to ``dtype`` (bfloat16 or float16).

    ``key`` (a 64-bit int) fixes the random bits; by default the next key of the global stream
    (:func:`kiln.precision.manual_seed`)."""
    return _cast(x, dtype, "sr", key)


def round_nearest(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x`` (float32) rounded to nearest-even in ``dtype`` (the same bits as ``x.to(dtype)``)."""
    return _cast(x, dtype, "rne", 0)


def _cast(x: torch.Tensor, dtype: torch.dtype, mode: str, key: int | None) -> torch.Tensor:
    if dtype not in _SR_DTYPES:
        raise TypeError(f"rounding targets are torch.bfloat16 and torch.float16, got {dtype}")
    x = _check_cpu_float(x, "stochastic_round")
    y = torch.empty(x.shape, dtype=dtype)
    if x.numel():
        k = rounding.next_key() if key is None else key & ((1 << 64) - 1)
        kernels.cast_fn(f"kp_cast_{_SR_DTYPES[dtype]}_{mode}")(
            x.data_ptr(), y.data_ptr(), x.numel(), k
        )
    return y


def _scale_arg(scale, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    cols = x.shape[-1] if x.dim() else 1
    rows = x.numel() // cols if cols else 0
    s = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).contiguous()
    if s.numel() == 1:
        return s, rows, cols, 0
    if s.numel() != rows:
        raise ValueError(
            f"scale has {s.numel()} values; need 1 (per tensor) or {rows} (one per row of a "
            f"{tuple(x.shape)} tensor)"
        )
    return s, rows, cols, 1


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat = "e4m3",
    scale: float | torch.Tensor = 1.0,
    *,
    rounding_mode: str = "rne",
    saturate: bool = True,
    key: int | None = None,
) -> torch.Tensor:
    """Codes (uint8) of ``x * scale`` in ``fmt``: rounded to nearest-even (``"rne"``) or
    stochastically (``"sr"``).  Overflow gives +-max when ``saturate`` (also for +-inf), else inf
    (formats with inf) or NaN.  NaN stays NaN."""
    if rounding_mode not in ("rne", "sr"):
        raise ValueError(f"rounding_mode must be 'rne' or 'sr', got {rounding_mode!r}")
    f = fp8_format(fmt)
    x = _check_cpu_float(x, "quantize")
    s, rows, cols, step = _scale_arg(scale, x)
    codes = torch.empty(x.shape, dtype=torch.uint8 if f.bits <= 8 else torch.int16)
    if x.numel():
        fq, _ = kernels.quant_fns(f, rounding_mode == "sr", saturate)
        k = 0 if rounding_mode == "rne" else (rounding.next_key() if key is None else key)
        fq(x.data_ptr(), s.data_ptr(), rows, cols, step, codes.data_ptr(), k & ((1 << 64) - 1))
    return codes


def dequantize(
    codes: torch.Tensor, fmt: str | FloatFormat = "e4m3", scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """float32 values of ``codes`` (uint8, or a torch float8 tensor) divided by ``scale``."""
    f = fp8_format(fmt)
    if codes.dtype != torch.uint8:
        if codes.element_size() != 1:
            raise TypeError(f"dequantize expects uint8 codes or a float8 tensor, got {codes.dtype}")
        codes = codes.view(torch.uint8)
    codes = codes.contiguous()
    s, rows, cols, step = _scale_arg(scale, codes)
    y = torch.empty(codes.shape, dtype=torch.float32)
    if codes.numel():
        _, fd = kernels.quant_fns(f, False, True)
        fd(codes.data_ptr(), s.data_ptr(), rows, cols, step, y.data_ptr())
    return y
