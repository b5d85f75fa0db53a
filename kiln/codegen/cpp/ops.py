"""C++ formulas for the pointwise ATen ops the fuser may put into a generated kernel.

Each entry turns one ATen call (its operands already as C++ expressions of known C types) into one
C++ expression.  The formulas follow ATen's CPU kernels (e.g. GELU's erf form vs tanh form per
``approximate``, ``pow`` special cases), computing in float for float32 results.

``supported(op, args, kwargs)`` is what the fusion pass asks before it takes a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln.ir.node import In
from kiln.precision.cpp import HELPERS

# dtype -> the C type values are computed in (bf16 / fp16: float, rounded per op; see emit.py)
CTYPE = {
    torch.float32: "float",
    torch.bool: "bool",
    torch.int64: "int64_t",
    torch.bfloat16: "float",
    torch.float16: "float",
}


@dataclass(frozen=True)
class Operand:
    """An operand of a body op: a C++ expression and its C type (or a Python literal)."""

    expr: str
    ctype: str | None  # None: a Python literal (expr holds its C++ spelling)
    literal: Any = None
    # a tensor value's dtype abbreviation (None: a Python number, literal or lifted), whether it
    # is a 0-dim tensor (or a number), and whether it is one element broadcast everywhere: what
    # ATen's type promotion and scalar handling look at (kiln.codegen.cpp.scalars)
    dtype: str | None = None
    dim0: bool = True
    one: bool = True


def literal(v: Any) -> str:
    if isinstance(v, Operand):  # a keyword argument lifted into a graph input (alpha=-lr)
        return v.expr
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"{v}LL"
    if isinstance(v, float):
        if math.isnan(v):
            return "NAN"
        if math.isinf(v):
            return "INFINITY" if v > 0 else "(-INFINITY)"
        return repr(v)
    raise TypeError(f"no C++ literal for {v!r}")


def cast(o: Operand, t: str) -> str:
    if o.ctype == t:
        return o.expr
    return f"(({t})({o.expr}))"


def _compute_type(ops: list[Operand]) -> str:
    """ATen promotion, restricted to what the fuser accepts: float wins, then int64, then bool."""
    if any(o.ctype == "float" for o in ops):
        return "float"
    if any(o.ctype is None and isinstance(o.literal, float) for o in ops):
        return "float"
    if any(o.ctype == "double" for o in ops):
        return "float"
    if any(
        o.ctype == "int64_t"
        or (o.ctype is None and isinstance(o.literal, int) and not isinstance(o.literal, bool))
        for o in ops
    ):
        return "int64_t"
    return "bool"


Formula = Callable[[list[Operand], dict, str], str]


def _binary(sym: str) -> Formula:
    def f(a: list[Operand], kw: dict, out: str) -> str:
        t = out if out != "bool" else _compute_type(a[:2])
        return f"({cast(a[0], t)} {sym} {cast(a[1], t)})"

    return f


def _alpha(sym: str) -> Formula:
    """``x + alpha * y`` / ``x - alpha * y``.  ``alpha`` is keyword-only in the Tensor overloads
    and positional in the Scalar ones (``add.Scalar(self, other, alpha=1)``).  Floating point
    uses one fused multiply-add, as ATen's CPU kernels do (``vec::fmadd``), so results agree
    bit for bit, overflow edges included."""

    def f(a: list[Operand], kw: dict, out: str) -> str:
        alpha = kw["alpha"] if "alpha" in kw else (a[2] if len(a) > 2 else 1)
        if isinstance(alpha, Operand) and alpha.ctype is None:
            alpha = alpha.literal  # a Python literal passed positionally
        x, y = cast(a[0], out), cast(a[1], out)
        if not isinstance(alpha, Operand) and alpha == 1:
            return f"({x} {sym} {y})"
        scale = f"(({out}){literal(alpha)})"
        if out in ("float", "double"):
            sign = "-" if sym == "-" else ""
            return f"km::fma({y}, {sign}{scale}, {x})"
        return f"({x} {sym} ({scale} * {y}))"

    return f


def _compare(sym: str) -> Formula:
    def f(a: list[Operand], kw: dict, out: str) -> str:
        t = _compute_type(a[:2])
        return f"({cast(a[0], t)} {sym} {cast(a[1], t)})"

    return f


def _unary(tmpl: str) -> Formula:
    def f(a: list[Operand], kw: dict, out: str) -> str:
        return tmpl.format(x=cast(a[0], out), t=out)

    return f


def _pow_tensor_scalar(a: list[Operand], kw: dict, out: str) -> str:
    x, e = cast(a[0], out), a[1].literal
    special = {
        2: f"({x} * {x})",
        3: f"({x} * {x} * {x})",
        0.5: f"km::sqrt({x})",
        -0.5: f"((({out})1) / km::sqrt({x}))",
        -1: f"((({out})1) / {x})",
        -2: f"((({out})1) / ({x} * {x}))",
        1: x,
    }
    if a[1].ctype is None and e in special:
        return special[e]
    return f"km::pow({x}, {cast(a[1], out)})"


def _gelu(a: list[Operand], kw: dict, out: str) -> str:
    x = cast(a[0], out)
    if kw.get("approximate", "none") == "tanh":
        return (
            f"(0.5f * {x} * (1.0f + km::tanh(0.7978845608028654f * "
            f"km::fma(0.044715f, {x} * {x} * {x}, {x}))))"
        )
    return f"({x} * 0.5f * (1.0f + kiln_erf_cdf({x} * 0.7071067811865476f)))"


def _gelu_backward(a: list[Operand], kw: dict, out: str) -> str:
    g, x = cast(a[0], out), cast(a[1], out)
    if kw.get("approximate", "none") == "tanh":
        return f"kiln_gelu_tanh_bwd({g}, {x})"
    return f"kiln_gelu_bwd({g}, {x})"


def _where(a: list[Operand], kw: dict, out: str) -> str:
    return f"({cast(a[0], 'bool')} ? {cast(a[1], out)} : {cast(a[2], out)})"


def _masked_fill(a: list[Operand], kw: dict, out: str) -> str:
    return f"({cast(a[1], 'bool')} ? {cast(a[2], out)} : {cast(a[0], out)})"


def _clamp(a: list[Operand], kw: dict, out: str) -> str:
    x = cast(a[0], out)
    lo = a[1] if len(a) > 1 else None
    hi = a[2] if len(a) > 2 else None
    if lo is not None and not (lo.ctype is None and lo.literal is None):
        x = f"kiln_max({x}, {cast(lo, out)})"
    if hi is not None and not (hi.ctype is None and hi.literal is None):
        x = f"kiln_min({x}, {cast(hi, out)})"
    return x


def _fma(a: list[Operand], kw: dict, out: str) -> str:
    return f"km::fma({cast(a[0], out)}, {cast(a[1], out)}, {cast(a[2], out)})"


def _addc(sym: str) -> Formula:
    """addcmul / addcdiv: ``self + value * t1 sym t2``, as ATen's CPU kernel computes it.  ATen's
    addcmul is built with FMA contraction: ``fma(value * t1, t2, self)`` (one rounding for the
    final multiply and add: where the product overflows, eager gives inf, not NaN); addcdiv
    divides, so nothing fuses there."""

    def f(a: list[Operand], kw: dict, out: str) -> str:
        x, t1, t2 = (cast(o, out) for o in a[:3])
        value = kw.get("value", 1)
        v = f"(({out}){literal(value)})" if not isinstance(value, Operand) else cast(value, out)
        if sym == "*" and out in ("float", "double"):
            return f"km::fma({v} * {t1}, {t2}, {x})"
        return f"({x} + {v} * {t1} {sym} {t2})"

    return f


def _lerp(a: list[Operand], kw: dict, out: str) -> str:
    """ATen's lerp (``LerpKernel.cpp``'s ``lerp_vec``): ``w < 0.5 ? self + w * (end - self) :
    end + (w - 1) * (end - self)``, each as one fused multiply-add."""
    x, e, w = cast(a[0], out), cast(a[1], out), cast(a[2], out)
    small = f"(kiln_abs({w}) < ({out})0.5)"
    if out in ("float", "double"):
        return f"km::fma({small} ? {w} : ({w} - (({out})1)), ({e} - {x}), {small} ? {x} : {e})"
    return f"({small} ? ({x} + {w} * ({e} - {x})) : ({e} - ({e} - {x}) * ((({out})1) - {w})))"


def _copy(a: list[Operand], kw: dict, out: str) -> str:
    return cast(a[1], out)


def _ident(a: list[Operand], kw: dict, out: str) -> str:
    return cast(a[0], out)


FORMULAS: dict[str, Formula] = {
    "add.Tensor": _alpha("+"),
    "add.Scalar": _alpha("+"),
    "sub.Tensor": _alpha("-"),
    "sub.Scalar": _alpha("-"),
    "mul.Tensor": _binary("*"),
    "mul.Scalar": _binary("*"),
    "div.Tensor": _binary("/"),
    "div.Scalar": _binary("/"),
    "eq.Tensor": _compare("=="),
    "eq.Scalar": _compare("=="),
    "ne.Tensor": _compare("!="),
    "ne.Scalar": _compare("!="),
    "lt.Tensor": _compare("<"),
    "lt.Scalar": _compare("<"),
    "le.Tensor": _compare("<="),
    "le.Scalar": _compare("<="),
    "gt.Tensor": _compare(">"),
    "gt.Scalar": _compare(">"),
    "ge.Tensor": _compare(">="),
    "ge.Scalar": _compare(">="),
    "logical_and.default": lambda a, kw, o: f"({cast(a[0], 'bool')} && {cast(a[1], 'bool')})",
    "logical_or.default": lambda a, kw, o: f"({cast(a[0], 'bool')} || {cast(a[1], 'bool')})",
    "logical_not.default": lambda a, kw, o: f"(!{cast(a[0], 'bool')})",
    "bitwise_not.default": lambda a, kw, o: (
        f"(!{a[0].expr})" if o == "bool" else f"(~{cast(a[0], o)})"
    ),
    "neg.default": _unary("(-{x})"),
    "abs.default": _unary("km::abs({x})"),
    "exp.default": _unary("km::exp({x})"),
    "expm1.default": _unary("km::expm1({x})"),
    "log.default": _unary("km::log({x})"),
    "log1p.default": _unary("km::log1p({x})"),
    "log2.default": _unary("km::log2({x})"),
    "sqrt.default": _unary("km::sqrt({x})"),
    "rsqrt.default": _unary("((({t})1) / km::sqrt({x}))"),
    "reciprocal.default": _unary("((({t})1) / {x})"),
    "sin.default": _unary("km::sin({x})"),
    "cos.default": _unary("km::cos({x})"),
    "tanh.default": _unary("km::tanh({x})"),
    "erf.default": _unary("km::erf({x})"),
    "sigmoid.default": _unary("((({t})1) / ((({t})1) + km::exp(-{x})))"),
    "silu.default": _unary("({x} / ((({t})1) + km::exp(-{x})))"),
    "relu.default": _unary("kiln_max({x}, ({t})0)"),
    "square.default": _unary("({x} * {x})"),
    "sign.default": _unary("(({t})(({x} > 0) - ({x} < 0)))"),
    "pow.Tensor_Scalar": _pow_tensor_scalar,
    "pow.Scalar": lambda a, kw, o: f"km::pow({cast(a[0], o)}, {cast(a[1], o)})",
    "pow.Tensor_Tensor": lambda a, kw, o: f"km::pow({cast(a[0], o)}, {cast(a[1], o)})",
    "maximum.default": lambda a, kw, o: f"kiln_max({cast(a[0], o)}, {cast(a[1], o)})",
    "minimum.default": lambda a, kw, o: f"kiln_min({cast(a[0], o)}, {cast(a[1], o)})",
    "clamp_min.default": lambda a, kw, o: f"kiln_max({cast(a[0], o)}, {cast(a[1], o)})",
    "clamp_max.default": lambda a, kw, o: f"kiln_min({cast(a[0], o)}, {cast(a[1], o)})",
    "clamp.default": _clamp,
    "gelu.default": _gelu,
    "gelu_backward.default": _gelu_backward,
    "where.self": _where,
    "masked_fill.Scalar": _masked_fill,
    "masked_fill.Tensor": _masked_fill,
    "sigmoid_backward.default": lambda a, kw, o: (
        f"({cast(a[0], o)} * ((({o})1) - {cast(a[1], o)}) * {cast(a[1], o)})"
    ),
    # ATen: grad * (1 - y * y), the inner part contracted to one fused multiply-add
    "tanh_backward.default": lambda a, kw, o: (
        f"({cast(a[0], o)} * km::fma(-{cast(a[1], o)}, {cast(a[1], o)}, (({o})1)))"
    ),
    "threshold_backward.default": lambda a, kw, o: (
        f"(({cast(a[1], 'float')} <= {cast(a[2], 'float')}) ? ({o})0 : {cast(a[0], o)})"
    ),
    "silu_backward.default": lambda a, kw, o: f"kiln_silu_bwd({cast(a[0], o)}, {cast(a[1], o)})",
    "fma.default": _fma,
    "addcmul.default": _addc("*"),
    "addcdiv.default": _addc("/"),
    "lerp.Scalar": _lerp,
    "lerp.Tensor": _lerp,
    "copy.default": _copy,
    "clone.default": _ident,
    "_to_copy.default": _ident,
    "alias.default": _ident,
}

# Helpers every generated translation unit starts with.  No <cmath>: parsing it is about a third of
# a small unit's compile time, so the few math functions the formulas use are declared here (``km::``
# overloads over GCC's builtins: the same libm calls <cmath>'s float/double overloads make).  The
# float functions are declared ``omp declare simd``: inside vectorized loops GCC calls glibc's
# libmvec variants (linked with -lmvec) instead of one scalar libm call per element.
PRELUDE = r"""
#include <cstdint>
#include <omp.h>
extern "C" {  // SIMD variants from glibc's libmvec, so that `omp simd` loops vectorize these calls
#pragma omp declare simd notinbranch
float expf(float);
#pragma omp declare simd notinbranch
float expm1f(float);
#pragma omp declare simd notinbranch
float logf(float);
#pragma omp declare simd notinbranch
float log1pf(float);
#pragma omp declare simd notinbranch
float log2f(float);
#pragma omp declare simd notinbranch
float sinf(float);
#pragma omp declare simd notinbranch
float cosf(float);
#pragma omp declare simd notinbranch
float tanhf(float);
#pragma omp declare simd notinbranch
float erff(float);
#pragma omp declare simd notinbranch
float powf(float, float);
}
#define INFINITY (__builtin_inff())
// Every helper is forced inline: at -O2 gcc inlines a big static function (erf) only where it has
// one caller, and a loop that calls it out of line stays scalar (a GELU backward kernel ran ~9x
// slower in a unit where both GELU kernels called erf).
#define KI static inline __attribute__((always_inline))
#define NAN (__builtin_nanf(""))
namespace km {
#define KM_UNARY(name) \
  KI float name(float x) { return __builtin_##name##f(x); } \
  KI double name(double x) { return __builtin_##name(x); }
KM_UNARY(expm1) KM_UNARY(log) KM_UNARY(log1p) KM_UNARY(log2) KM_UNARY(sqrt)
KM_UNARY(sin) KM_UNARY(cos) KM_UNARY(tanh)
#undef KM_UNARY
// exp(float) as ATen's vectorized CPU kernels compute it (Vectorized<float>::exp: SLEEF's 1-ulp
// expf), so that a fused kernel's exp is eager's to the bit: the same reduction x = n*ln2 + s (ln2
// split in two), the same degree-6 polynomial in fused multiply-adds, the same 2^n applied in two
// halves (results below 2^-126 come out as the same subnormals); x < -104 -> 0, x > 100 -> inf,
// NaN -> NaN.  Every lane takes one path: an out-of-range argument is replaced by 0 first (its
// result is picked after; a masked -inf lane clamped to the range's end instead computed a
// product that underflows, a microcode assist per lane on some CPUs) and the out-of-range results
// are picked after, two one-sided selects each way (one nested select made gcc branch and mask
// every vector op: ~1.4x slower in a SiLU backward kernel).  Checked against ATen over all 2^32
// inputs (tests/codegen/test_exp_bits.py).
KI float exp(float x) {
  const float top = x > 100.0f ? 0.0f : x;
  const float c = top < -104.0f ? 0.0f : top;
  const float d = c == c ? c : 0.0f;
  const float n = __builtin_rintf(d * 1.44269504088896341f);
  float s = __builtin_fmaf(n, -0.693145751953125f, d);
  s = __builtin_fmaf(n, -1.428606765330187e-06f, s);
  float p = 1.98527617612853646e-4f;
  p = __builtin_fmaf(p, s, 1.39304355252534151e-3f);
  p = __builtin_fmaf(p, s, 8.33336077630519867e-3f);
  p = __builtin_fmaf(p, s, 4.16664853692054749e-2f);
  p = __builtin_fmaf(p, s, 1.66666671633720398e-1f);
  p = __builtin_fmaf(p, s, 0.5f);
  const float y = 1.0f + __builtin_fmaf(s * s, p, s);
  const int32_t k = (int32_t)n, h = k >> 1;
  union { int32_t i; float f; } lo, hi;
  lo.i = (h + 127) << 23;
  hi.i = (k - h + 127) << 23;
  const float e = y * lo.f * hi.f;
  const float under = x < -104.0f ? 0.0f : e;
  const float over = x > 100.0f ? INFINITY : under;
  return x == x ? over : x;
}
KI double exp(double x) { return __builtin_exp(x); }
// log(float) as ATen's vectorized CPU kernels compute it (Vectorized<float>::log: SLEEF's 1-ulp
// logf), for the log-softmax's log of the row sum: d = m * 2^e with m in [0.75, 1.5), then
// log d = e*ln2 + 2x + x^3 p(x^2), x = (m - 1) / (m + 1), the terms added as float pairs (value +
// rounding error) and rounded once at the end.  Checked against eager's log-softmax over every
// float sum in (1, 2] and 1..4999 (tests/codegen/test_exp_bits.py).
KI float log_vec(float d) {
  const int tiny = d < 1.17549435e-38f;
  const float dd = tiny ? d * 1.8446744073709552e19f : d;  // * 2^64 for subnormals
  union { float f; int32_t i; } b, mb;
  b.f = dd * (1.0f / 0.75f);
  int32_t e = ((b.i >> 23) & 0xff) - 0x7f;
  mb.f = dd;
  mb.i -= e << 23;
  const float m = mb.f;
  if (tiny) e -= 64;
  const float ef = (float)e;
  const float lh = 0.69314718246459960938f, ll = -1.904654323148236017e-09f;  // ln2 as a pair
  const float sx = lh * ef;
  const float sy = __builtin_fmaf(ll, ef, __builtin_fmaf(lh, ef, -sx));
  float v;
  const float nx = -1.0f + m;  // m - 1 and m + 1 as exact pairs
  v = nx - (-1.0f);
  const float ny = (-1.0f - (nx - v)) + (m - v);
  const float qx = 1.0f + m;
  v = qx - 1.0f;
  const float qy = (1.0f - (qx - v)) + (m - v);
  const float t = 1.0f / qx;  // x = n / q as a pair
  const float xx = nx * t;
  const float u = __builtin_fmaf(t, nx, -xx);
  const float w = __builtin_fmaf(-qy, t, __builtin_fmaf(-qx, t, 1.0f));
  const float xy = __builtin_fmaf(xx, w, __builtin_fmaf(ny, t, u));
  const float x2 = xx * xx;
  float p = 0.3027294874f;
  p = __builtin_fmaf(p, x2, 0.3996108174f);
  p = __builtin_fmaf(p, x2, 0.6666694880f);
  const float ax = xx * 2.0f, ay = xy * 2.0f;  // + 2x
  const float s2x = sx + ax;
  const float s2y = (((sx - s2x) + ax) + sy) + ay;
  const float c = (x2 * xx) * p;  // + x^3 p
  const float s3x = s2x + c;
  const float s3y = ((s2x - s3x) + c) + s2y;
  const float r = s3x + s3y;
  const float inf = d == INFINITY ? INFINITY : r;
  const float neg = (d < 0.0f || d != d) ? NAN : inf;
  return d == 0.0f ? -INFINITY : neg;
}
// erf(float): for |x| < 1 its Taylor series (11 terms: truncation < 2e-9, so relative error
// ~1 ulp, tiny x included); beyond, Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, ~2 ulp there).
// Built on exp, so it vectorizes ~1.4x faster than libmvec's erff.
KI float erf(float x) {
  const float a0 = __builtin_fabsf(x), ax = a0 > 10.0f ? 10.0f : a0;  // erf(10) == 1; NaN stays
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  const float r = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t
                    - 0.284496736f) * t + 0.254829592f) * t;
  const float big = __builtin_copysignf(1.0f - r * exp(-ax * ax), x);
  const float x2 = x * x;
  float p = 1.4807192815879218e-08f;
  p = __builtin_fmaf(p, x2, -1.6365844691234924e-07f);
  p = __builtin_fmaf(p, x2, 1.6462114365889246e-06f);
  p = __builtin_fmaf(p, x2, -1.492565035840625e-05f);
  p = __builtin_fmaf(p, x2, 0.00012055332981789664f);
  p = __builtin_fmaf(p, x2, -0.0008548327023450852f);
  p = __builtin_fmaf(p, x2, 0.005223977625442188f);
  p = __builtin_fmaf(p, x2, -0.026866170645131252f);
  p = __builtin_fmaf(p, x2, 0.11283791670955126f);
  p = __builtin_fmaf(p, x2, -0.37612638903183754f);
  p = __builtin_fmaf(p, x2, 1.1283791670955126f);
  return a0 < 1.0f ? x * p : big;
}
KI double erf(double x) { return __builtin_erf(x); }
KI float abs(float x) { return __builtin_fabsf(x); }
KI double abs(double x) { return __builtin_fabs(x); }
KI int64_t abs(int64_t x) { return x < 0 ? -x : x; }
KI float pow(float a, float b) { return __builtin_powf(a, b); }
KI double pow(double a, double b) { return __builtin_pow(a, b); }
// Integer powers as ATen's powi: exact, by repeated squaring, wrapping on overflow (done in
// unsigned arithmetic, where wrapping is defined); a negative exponent gives 1 for base 1, +-1 for
// base -1 and 0 otherwise.  (Through double, results past 2^53 lost their low digits and an
// overflow gave INT64_MIN where eager wraps.)
KI int64_t pow(int64_t a, int64_t b) {
  if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)a;
  for (uint64_t e = (uint64_t)b; e; e >>= 1) {
    if (e & 1) r *= x;
    x *= x;
  }
  return (int64_t)r;
}
KI float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
KI double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }
}  // namespace km
template <typename T> KI T kiln_abs(T a) { return a < 0 ? -a : a; }
// Scratch buffers of whole 64-byte cache lines: per-thread buffers allocated one after the other
// share a line at their boundary, and every write to it bounces the line between the cores (a
// column-sum variant whose threads each filled a row buffer, add + column sum at 256x128 on 2
// threads: 95 us with new[], 42 with these).  kiln_buf(n, zero) / kiln_free(p).
template <typename T> KI T* kiln_buf(int64_t n, int zero) {
  const unsigned long bytes = ((unsigned long)(n > 0 ? n : 1) * sizeof(T) + 63) / 64 * 64;
  char* raw = (char*)__builtin_malloc(bytes + 128);
  char* p = (char*)(((unsigned long)raw + 127) & ~63UL);
  ((char**)p)[-1] = raw;
  T* t = (T*)p;
  if (zero)
    for (int64_t k = 0; k < n; ++k) t[k] = T(0);
  return t;
}
KI void kiln_free(void* p) { __builtin_free(((char**)p)[-1]); }
template <typename T> KI T kiln_max(T a, T b) { return (a != a) ? a : (a > b ? a : b); }
template <typename T> KI T kiln_min(T a, T b) { return (a != a) ? a : (a < b ? a : b); }
// The backward formulas below group and fuse (km::fma) as ATen's vectorized CPU kernels do
// (ATen's are built with multiply-add contraction).
// erf for GELU's cdf 0.5 * (1 + erf(x / sqrt(2))), computed as ATen's vectorized CPU kernel
// computes it (Vectorized<float>::erf: Abramowitz & Stegun 7.1.26 over the whole range,
// |error| < 1.5e-7, 1 - erf carrying it for large |x|): close to eager's values and half the work
// of km::erf, whose extra Taylor branch buys relative accuracy for tiny |x| that 1 + erf drops.
KI float kiln_erf_as(float x, float e) {  // e = exp(-x * x)
  const float t = 1.0f / km::fma(0.3275911f, __builtin_fabsf(x), 1.0f);
  const float r = km::fma(km::fma(km::fma(km::fma(1.061405429f, t, -1.453152027f), t,
                  1.421413741f), t, -0.284496736f), t, 0.254829592f);
  return __builtin_copysignf(km::fma(-e * t, r, 1.0f), x);
}
KI float kiln_erf_cdf(float x) { return kiln_erf_as(x, km::exp(-(x * x))); }
// One exp serves both terms: exp(-z * z) for z = x / sqrt(2) is the pdf's exp(-x * x / 2)
// (ATen computes it twice, from arguments that differ in the last bit: results agree to ~1e-7).
KI float kiln_gelu_bwd(float g, float x) {
  const float e = km::exp(x * x * -0.5f);
  const float cdf = 0.5f * (1.0f + kiln_erf_as(x * 0.7071067811865476f, e));
  const float pdf = 0.3989422804014327f * e;
  return g * km::fma(x, pdf, cdf);
}
KI float kiln_gelu_tanh_bwd(float g, float x) {
  const float k = 0.7978845608028654f, c = 0.044715f;
  const float x2 = x * x, inner = k * km::fma(c, x * x * x, x);
  const float t = km::tanh(inner);
  const float left = 0.5f * x, right = 1.0f + t;
  const float dinner = k * km::fma(3.0f * c, x2, 1.0f);
  return g * km::fma(left * km::fma(-t, t, 1.0f), dinner, 0.5f * right);
}
KI float kiln_silu_bwd(float g, float x) {
  const float s = 1.0f / (1.0f + km::exp(-x));
  return g * s * km::fma(x, 1.0f - s, 1.0f);
}
"""


def register_formula(op: str, formula: Formula | str, replace: bool = False) -> None:
    """Teach the C++ backend one more pointwise op (``"sinc.default"``): its op record (kiln.ir.ops)
    says what it means, this says how to write it in C++.  ``formula`` is a Formula or a unary
    template with ``{x}`` (the operand, cast to the output type) and ``{t}`` (that C type)."""
    if op in FORMULAS and not replace:
        raise ValueError(f"the C++ backend already has a formula for {op!r}")
    FORMULAS[op] = _unary(formula) if isinstance(formula, str) else formula


def unregister_formula(op: str) -> None:
    FORMULAS.pop(op, None)


PRELUDE += HELPERS  # bf16 / fp16 / fp8 rounding (kiln.precision.cpp)


def _literal_ok(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return False


def supported(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether the fuser may take this call (op known, no tensor-list or odd arguments)."""
    if op == "roll.default":
        # a read at a rotated index (kiln.codegen.cpp.emit); the fuser checks the roll's form
        return not kwargs
    if op not in FORMULAS:
        return False
    if op == "_to_copy.default":
        allowed = {"dtype", "layout", "device", "pin_memory"}
        if set(kwargs) - allowed or kwargs.get("dtype") not in CTYPE:
            return False
        if kwargs.get("layout") not in (None, torch.strided):
            return False
    if op == "clone.default":
        return set(kwargs) <= {"memory_format"} and kwargs.get("memory_format") in (
            None,
            torch.contiguous_format,
            torch.preserve_format,
        )
    if op in ("gelu.default", "gelu_backward.default"):
        if kwargs.get("approximate", "none") not in ("none", "tanh"):
            return False
        return True
    for v in kwargs.values():
        if not _literal_ok(v) and not isinstance(v, In):
            if op not in ("_to_copy.default",):
                return False
    return True
