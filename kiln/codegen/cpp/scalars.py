"""What ATen's CPU kernels do to the other operands of a bfloat16 / float16 op, emulated.

Kiln's formulas compute a bf16 / fp16 op in float and round its result once (``emit.py``).  ATen
does the same with the op's tensors, but first casts every input to the op's common dtype
(TensorIterator's ``promote_inputs_to_common_dtype``): a Python number, a 0-dim float32 tensor or
an int64 tensor mixed into a bf16 op is rounded to bf16 before the op, so ``bf16 + 0.1`` adds
0.10009765625, ``bf16 <= 0.1`` compares with it and ``add(x, y, alpha=0.37)`` scales by
0.369140625 (``alpha.to<scalar_t>()``).  Without this, 1-4% of the elements of such ops came out
one unit in the last place off eager's.  Which operands are rounded is each kernel's own choice:

  add, sub          every operand and ``alpha`` (the ufunc kernel: ``fmadd(other, alpha, self)``)
  eq ne lt le gt ge every operand (comparisons promote to the common dtype)
  maximum minimum   every operand
  mul, div (true)   the first operand; the second only where it is not one element: a one-element
                    second operand is read at float precision (``original_scalar_value``)
  pow.Tensor_Scalar the exponent (``exp_scalar.to<scalar_t>()``), then per dtype (below)
  pow.Scalar        the base (a wrapped number cast to the exponent tensor's dtype)
  pow.Tensor_Tensor every operand

Not rounded (the kernel converts the number to float): ``lerp``'s weight, ``addcmul``/``addcdiv``'s
``value``, ``clamp``'s bounds (a result rounded once either way), and the numeric parameters of
activations (``leaky_relu``'s slope, ``elu``'s alpha, ...), which are not operands at all.

``pow`` by a Python number in bf16 (``pow_tensor_scalar_kernel``): exponents 0.5, -0.5, -1 (before
rounding) take ``sqrt``/``rsqrt``/``reciprocal``; after rounding, 2 is ``x * x``, 3 is
``x * x * x`` and -2 is ``1 / (x * x)`` computed on bf16 vectors, so each product is rounded;
any other exponent is ``pow``.  In float16 every exponent is ``pow`` (no special cases:
``(-inf) ** 0.5`` is ``inf`` there, ``NaN`` in float32 and bf16), except that ``x * x`` is kept
for 2 (exact in float, one rounding: the correctly rounded square ``pow`` also gives).

``sigmoid_backward`` in float16: ATen's kernel computes ``a * (1 - b) * b`` on float16 vectors (its
bf16 branch converts to float; float16 takes the generic one), each operation rounded: 2,467 of
8,192 elements were off; :func:`half_formula` spells that out.

Not emulated: ATen's scalar tail of a vectorized loop, and every element of a non-contiguous input,
compute ``add`` with ``alpha != 1`` as ``self + alpha * other`` in ``c10::BFloat16`` arithmetic,
rounding the product too; Kiln rounds once everywhere, as ATen's vector body does.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kiln.codegen.cpp.ops import Operand, cast, literal
from kiln.precision import cpp as lowp

_FLOATS = ("bf16", "f16", "f32", "f64")
_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16}
_BOTH = (0, 1)
# op -> the positions of the operands its ATen kernel casts to a bf16 / fp16 common dtype
ROUNDED: dict[str, tuple[int, ...]] = {
    **{f"{op}.{ov}": _BOTH for op in ("add", "sub") for ov in ("Tensor", "Scalar")},
    **{
        f"{op}.{ov}": _BOTH
        for op in ("eq", "ne", "lt", "le", "gt", "ge")
        for ov in ("Tensor", "Scalar")
    },
    **{f"{op}.{ov}": _BOTH for op in ("mul", "div") for ov in ("Tensor", "Scalar")},
    "maximum.default": _BOTH,
    "minimum.default": _BOTH,
    "pow.Tensor_Tensor": _BOTH,
    "pow.Tensor_Scalar": (1,),
    "pow.Scalar": (0,),
}
# ops whose kernel reads a one-element second operand at float precision (not rounded)
_FLOAT_SCALAR = frozenset(f"{op}.{ov}" for op in ("mul", "div") for ov in ("Tensor", "Scalar"))
_ALPHA = frozenset(f"{op}.{ov}" for op in ("add", "sub") for ov in ("Tensor", "Scalar"))


def common_dtype(ops: list[Operand]) -> str | None:
    """The bf16 / fp16 dtype ATen's type promotion gives these operands, or None for any other.

    Tensors with dimensions decide over 0-dim tensors, which decide over Python numbers, within a
    category; a number of a higher category (a float with integer tensors) makes the default
    float type, never a reduced one."""
    for tier in (False, True):  # tensors with dimensions first, then 0-dim ones
        dts = [o.dtype for o in ops if o.dtype is not None and o.dim0 is tier]
        if dts:
            floats = {d for d in dts if d in _FLOATS}
            if len(floats) == 1 and next(iter(floats)) in lowp.LOWP:
                return next(iter(floats))
            if floats:
                return None
    return None


def round_number(v: Any, abbr: str) -> Any:
    """A Python number as ATen casts it to ``abbr`` (through float32, as ``c10::convert`` does);
    an int stays an int where the result is one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    r = torch.tensor(float(v), dtype=torch.float32).to(_TORCH[abbr]).item()
    if isinstance(v, int) and math.isfinite(r) and r == int(r):
        return int(r)
    return r


def _round(o: Operand, abbr: str) -> Operand:
    if o.ctype is None:  # a Python literal: rounded here, still a literal for the formulas
        v = round_number(o.literal, abbr)
        return replace(o, expr=literal(v), literal=v)
    expr = lowp.round_expr(abbr, f"(float)({o.expr})", False, 0)
    return Operand(expr, "float", dtype=abbr, dim0=o.dim0, one=o.one)


def narrow(op: str, ops: list[Operand], kw: dict) -> tuple[list[Operand], dict, str | None]:
    """``op``'s operands (and ``alpha``) rounded as its ATen kernel rounds them in a bf16 / fp16
    op; the reduced dtype, or None when the op is not one (nothing changed)."""
    positions = ROUNDED.get(op)
    if positions is None:
        return ops, kw, None
    abbr = common_dtype(ops)
    if abbr is None:
        return ops, kw, None
    out = list(ops)
    for p in positions:
        if p >= len(out) or out[p].dtype == abbr:
            continue
        if p == 1 and op in _FLOAT_SCALAR and out[p].one:
            continue  # original_scalar_value: read at float precision
        out[p] = _round(out[p], abbr)
    if op in _ALPHA:
        if "alpha" in kw:
            a = kw["alpha"]
            kw = {
                **kw,
                "alpha": _round(a, abbr) if isinstance(a, Operand) else round_number(a, abbr),
            }
        elif len(out) > 2:  # add.Scalar(self, other, alpha) positional
            out[2] = _round(out[2], abbr)
    return out, kw, abbr


def pow_tensor_scalar(x: str, original: Any, e: Operand, out: str, abbr: str) -> str:
    """bf16 / fp16 ``x ** e`` (``e`` already rounded) as ATen's kernel computes it.  ``original``:
    the exponent before rounding (a Python number), or None for one known only at run time."""
    generic = f"km::pow({x}, (({out})({e.expr})))"
    if e.ctype is not None:
        return generic  # a run-time exponent: pow (its value is not known here)
    if abbr == "f16":
        return f"({x} * {x})" if e.literal == 2 else generic
    if original == 0.5:
        return f"km::sqrt({x})"
    if original == -0.5:
        return f"((({out})1) / km::sqrt({x}))"
    if original == -1:
        return f"((({out})1) / {x})"
    sq = lowp.round_expr(abbr, f"({x} * {x})", False, 0)
    special = {1: x, 2: f"({x} * {x})", 3: f"({sq} * {x})", -2: f"((({out})1) / {sq})"}
    return special.get(e.literal, generic)


def half_formula(op: str, ops: list[Operand], out: str) -> str | None:
    """float16 ``op`` as an ATen kernel that computes in float16 arithmetic does (every
    intermediate rounded; the emitter rounds the result), or None for ops computed in float."""
    if op != "sigmoid_backward.default":
        return None
    g, y = cast(ops[0], out), cast(ops[1], out)
    one_minus = lowp.round_expr("f16", f"((({out})1) - {y})", False, 0)
    return f"({lowp.round_expr('f16', f'({g} * {one_minus})', False, 0)} * {y})"
