"""Generated C++ kernels for the precision ops: stochastic casts, fp8 quantize / dequantize.

Built through Kiln's kernel cache (:mod:`kiln.codegen.cpp.build`), one translation unit per
(format, rounding, saturation), loaded once per process.  Formats and modes are compiled in;
sizes, scales and the random key are run-time arguments.
"""

from __future__ import annotations

import ctypes
import math
import threading

from kiln.codegen.cpp.build import build_many
from kiln.precision.cpp import HELPERS, encode_fn
from kiln.precision.formats import FloatFormat

PARALLEL_MIN = 32768
_HEAD = "#include <cstdint>\n#include <omp.h>\n" + HELPERS

_lock = threading.Lock()
_fns: dict[str, ctypes._CFuncPtr] = {}

_P, _I, _U = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64

_CAST_SRC = (
    _HEAD
    + f"""
#define KP_CAST(NAME, OUT_T, EXPR) \\
extern "C" void NAME(const float* x, OUT_T* y, int64_t n, uint64_t key) {{ \\
  _Pragma("omp parallel for simd if(parallel: n >= {PARALLEL_MIN})") \\
  for (int64_t i = 0; i < n; ++i) y[i] = EXPR; \\
}}
KP_CAST(kp_cast_bf16_sr, uint16_t, kp_bf16_sr(x[i], kp_rand64(key, i)))
KP_CAST(kp_cast_bf16_rne, uint16_t, kp_bf16_rne(x[i]))
KP_CAST(kp_cast_fp16_sr, _Float16, kp_fp16_sr(x[i], kp_rand64(key, i)))
KP_CAST(kp_cast_fp16_rne, _Float16, kp_fp16_rne(x[i]))
"""
)


def _load(unit_key: str, source: str, names: list[str], argtypes: list) -> None:
    with _lock:
        if all(n in _fns for n in names):
            return
        (lib,) = build_many([source])
        for n in names:
            f = getattr(lib, n)
            f.argtypes = argtypes
            f.restype = None
            _fns[n] = f


def cast_fn(name: str) -> ctypes._CFuncPtr:
    """``f(x*, y*, n, key)``: one of ``kp_cast_{bf16,fp16}_{sr,rne}``."""
    if name not in _fns:
        names = ["kp_cast_bf16_sr", "kp_cast_bf16_rne", "kp_cast_fp16_sr", "kp_cast_fp16_rne"]
        _load("cast", _CAST_SRC, names, [_P, _P, _I, _U])
    return _fns[name]


def quant_fns(fmt: FloatFormat, sr: bool, saturate: bool) -> tuple:
    """(quantize, dequantize) kernels for ``fmt``.

    quantize(x*, scale*, rows, cols, scale_step, codes*, key): codes = fmt(x * scale[r])
    dequantize(codes*, scale*, rows, cols, scale_step, y*):    y = value(codes) / scale[r]
    (``scale_step`` 0: one scale for the tensor; 1: one per row.)"""
    enc, enc_src = encode_fn(fmt, sr, saturate)
    q, d = f"{enc}_quant", f"kp_dec_{fmt.name}"
    if q in _fns and d in _fns:
        return _fns[q], _fns[d]
    ct = "uint8_t" if fmt.bits <= 8 else "uint16_t"
    table = ", ".join(_c_float(v) for v in fmt.table.tolist())
    src = (
        _HEAD
        + enc_src
        + f"""
static const float kp_table_{fmt.name}[{1 << fmt.bits}] = {{{table}}};
extern "C" void {q}(const float* x, const float* scale, int64_t rows, int64_t cols,
                    int64_t scale_step, {ct}* y, uint64_t key) {{
  #pragma omp parallel for if(rows * cols >= {PARALLEL_MIN})
  for (int64_t r = 0; r < rows; ++r) {{
    const float s = scale[r * scale_step];
    #pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {{
      const int64_t i = r * cols + j;
      y[i] = {enc}(x[i] * s, kp_rand64(key, i));
    }}
  }}
}}
extern "C" void {d}(const {ct}* c, const float* scale, int64_t rows, int64_t cols,
                    int64_t scale_step, float* y) {{
  #pragma omp parallel for if(rows * cols >= {PARALLEL_MIN})
  for (int64_t r = 0; r < rows; ++r) {{
    const float s = scale[r * scale_step];
    #pragma omp simd
    for (int64_t j = 0; j < cols; ++j) y[r * cols + j] = kp_table_{fmt.name}[c[r * cols + j]] / s;
  }}
}}
"""
    )
    with _lock:
        (lib,) = build_many([src])
        fq, fd = getattr(lib, q), getattr(lib, d)
        fq.argtypes = [_P, _P, _I, _I, _I, _P, _U]
        fd.argtypes = [_P, _P, _I, _I, _I, _P]
        fq.restype = fd.restype = None
        _fns[q], _fns[d] = fq, fd
    return fq, fd


def _c_float(v: float) -> str:
    if math.isnan(v):
        return '__builtin_nanf("")'
    if math.isinf(v):
        return "__builtin_inff()" if v > 0 else "(-__builtin_inff())"
    return f"{float(v).hex()}f" if v else ("-0.0f" if str(v).startswith("-") else "0.0f")
