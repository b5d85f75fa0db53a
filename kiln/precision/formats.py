"""Floating-point formats Kiln can round to: bf16, fp16 and the 8-bit families.

A :class:`FloatFormat` is (exponent bits, mantissa bits, bias, special-value encoding):

  ``ieee``  all-ones exponent is inf (mantissa 0) or NaN (E5M2, fp16, bf16)
  ``fn``    no inf; only S.1111...1 is NaN, the rest of the top binade is finite (OCP E4M3, E3M4)
  ``fnuz``  no inf, no negative zero; the code 0x80 (``-0``) is the only NaN (AMD/Graphcore fnuz)

``fmt.with_bias(b)`` is the same layout with another exponent bias: every value is multiplied by
``2**(fmt.bias - b)``, so a bias shift of ``k`` is bit-exactly a scale of ``2**-k`` (Trainium's
configurable FP8).  Everything here is plain Python; the C++ that rounds to a format lives in
:mod:`kiln.precision.cpp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

ENCODINGS = ("ieee", "fn", "fnuz")


class FormatError(ValueError):
    pass


@dataclass(frozen=True)
class FloatFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    encoding: str = "ieee"
    torch_dtype: torch.dtype | None = None  # the torch dtype with exactly these codes, if any

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise FormatError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if not (1 <= self.ebits <= 8 and 0 <= self.mbits <= 15):
            raise FormatError(f"{self.name}: need 1 <= ebits <= 8 and 0 <= mbits <= 15")
        if self.bits > 16:
            raise FormatError(f"{self.name}: at most 16 bits per value (got {self.bits})")
        # every value (and the quantum of the subnormals) must be a normal fp32 power of two,
        # which the generated kernels build from exponent bits
        if self.emin - self.mbits < -126 or self.emax > 127:
            raise FormatError(
                f"{self.name}: bias {self.bias} puts the format outside fp32's normal range "
                f"(smallest quantum 2^{self.emin - self.mbits}, largest exponent {self.emax}); "
                "use a bias that keeps both within [2^-126, 2^127]"
            )

    # ---- derived constants -------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def top_field(self) -> int:
        """The largest exponent field that holds finite values."""
        all_ones = (1 << self.ebits) - 1
        return all_ones - 1 if self.encoding == "ieee" else all_ones

    @property
    def emax(self) -> int:
        return self.top_field - self.bias

    @property
    def max_mantissa_field(self) -> int:
        full = (1 << self.mbits) - 1
        return full - 1 if self.encoding == "fn" else full

    @property
    def max(self) -> float:
        return (1 + self.max_mantissa_field / (1 << self.mbits)) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def has_inf(self) -> bool:
        return self.encoding == "ieee"

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def max_code(self) -> int:
        return (self.top_field << self.mbits) | self.max_mantissa_field

    @property
    def inf_code(self) -> int:
        if not self.has_inf:
            raise FormatError(f"{self.name} has no infinity")
        return ((1 << self.ebits) - 1) << self.mbits

    @property
    def nan_code(self) -> int:
        """The positive NaN code (fnuz: the single NaN, 0x80)."""
        if self.encoding == "fnuz":
            return self.sign_bit
        return ((1 << self.ebits) - 1) << self.mbits | ((1 << self.mbits) - 1)

    def with_bias(self, bias: int) -> FloatFormat:
        """The same encoding with exponent bias ``bias``: values scaled by 2**(self.bias - bias)."""
        return FloatFormat(
            f"{self.name}b{bias}", self.ebits, self.mbits, bias, self.encoding,
            self.torch_dtype if bias == self.bias else None,
        )  # fmt: skip

    # ---- decoding (exact, in Python) ---------------------------------------------------------
    def decode(self, code: int) -> float:
        """The value of one code (NaN codes -> nan)."""
        n = 1 << self.bits
        if not 0 <= code < n:
            raise FormatError(f"{self.name}: code {code} out of range [0, {n})")
        sign = -1.0 if code & self.sign_bit else 1.0
        e = (code >> self.mbits) & ((1 << self.ebits) - 1)
        m = code & ((1 << self.mbits) - 1)
        all_ones = (1 << self.ebits) - 1
        if self.encoding == "fnuz" and code == self.sign_bit:
            return math.nan
        if self.encoding == "ieee" and e == all_ones:
            return sign * math.inf if m == 0 else math.nan
        if self.encoding == "fn" and e == all_ones and m == (1 << self.mbits) - 1:
            return math.nan
        if e == 0:
            return sign * m * 2.0 ** (self.emin - self.mbits)
        return sign * (1 + m / (1 << self.mbits)) * 2.0 ** (e - self.bias)

    @cached_property
    def table(self) -> torch.Tensor:
        """float32 value of every code (a dequantization lookup table)."""
        return torch.tensor([self.decode(c) for c in range(1 << self.bits)], dtype=torch.float32)


E4M3 = FloatFormat("e4m3", 4, 3, 7, "fn", torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, 15, "ieee", torch.float8_e5m2)
E4M3_FNUZ = FloatFormat("e4m3fnuz", 4, 3, 8, "fnuz", torch.float8_e4m3fnuz)
E5M2_FNUZ = FloatFormat("e5m2fnuz", 5, 2, 16, "fnuz", torch.float8_e5m2fnuz)
E3M4 = FloatFormat("e3m4", 3, 4, 3, "fn")  # max 30, min normal 0.25 (FP8 emulation toolkits)
FP16 = FloatFormat("fp16", 5, 10, 15, "ieee", torch.float16)

FP8_FORMATS: dict[str, FloatFormat] = {f.name: f for f in (E4M3, E5M2, E4M3_FNUZ, E5M2_FNUZ, E3M4)}


def fp8_format(name: str | FloatFormat, bias: int | None = None) -> FloatFormat:
    """A format by name (``"e4m3"``, ``"e5m2"``, ``"e4m3fnuz"``, ``"e5m2fnuz"``, ``"e3m4"``),
    optionally with a non-default exponent bias."""
    if isinstance(name, FloatFormat):
        fmt = name
    else:
        fmt = FP8_FORMATS.get(name)
        if fmt is None:
            raise FormatError(f"unknown fp8 format {name!r}; known: {', '.join(FP8_FORMATS)}")
    return fmt if bias is None or bias == fmt.bias else fmt.with_bias(bias)
