"""The formula cases: every entry of Kiln's C++ formula table and every kept-whole kernel, each as
an ATen call on inputs that cover its whole range (negative, zero, tiny, large, near overflow,
+-inf and NaN), so the generated code can be compared with ATen element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

aten = torch.ops.aten
prims = torch.ops.prims

# Float values over the whole range: signed zeros, tiny, ordinary, the exp/expm1 overflow and
# underflow edges (|x| ~ 88), huge (squares overflow), float max, infinities and NaN.
SPECIAL = [
    float("-inf"), -3.0e38, -1.0e20, -100.0, -88.8, -87.5, -20.0, -5.0, -2.5, -1.0, -0.75,
    -0.5, -0.1, -1.0e-3, -1.0e-30, -0.0, 0.0, 1.0e-30, 1.0e-3, 0.1, 0.5, 0.75, 1.0, 2.5, 5.0,
    20.0, 87.5, 88.8, 100.0, 1.0e20, 3.0e38, float("inf"), float("nan"),
]  # fmt: skip
N = len(SPECIAL)


def special() -> torch.Tensor:
    return torch.tensor(SPECIAL, dtype=torch.float32)


def grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of special values (x varies slowest)."""
    s = special()
    return s.repeat_interleave(N), s.repeat(N)


def values(n: int = 0) -> torch.Tensor:
    """The special values followed by ``n`` ordinary random ones (a fixed seed)."""
    g = torch.Generator().manual_seed(7)
    return torch.cat([special(), torch.randn(n, generator=g) * 3]) if n else special()


def smooth(n: int = 200) -> torch.Tensor:
    """Finite values where gradients are meaningful: dense around 0, out to +-30."""
    g = torch.Generator().manual_seed(3)
    return torch.cat(
        [torch.linspace(-30, 30, 121), torch.randn(n, generator=g) * 4, torch.tensor([0.0, -0.0])]
    )


def finite(limit: float = 1e20) -> torch.Tensor:
    """The special values with |x| <= limit (and NaN)."""
    s = special()
    return s[~(s.abs() > limit)]


def grad_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """(output gradient, x): moderate gradients times every special x."""
    g = torch.tensor([-100.0, -2.5, -1.0, -0.0, 0.0, 1.0, 2.5, 100.0])
    s = special()
    return g.repeat_interleave(N), s.repeat(len(g))


def _fma_inputs() -> tuple:
    a, b = grid()
    keep = torch.isfinite(a * b) | ~torch.isfinite(a) | ~torch.isfinite(b)
    return a[keep], b[keep], grid()[0].flip(0)[keep]


def ints() -> torch.Tensor:
    return torch.tensor([-(2**62), -7, -3, -2, -1, 0, 1, 2, 3, 7, 2**62], dtype=torch.int64)


def bools() -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor([False, False, True, True])
    return a, torch.tensor([False, True, False, True])


@dataclass
class Case:
    """``fn(*inputs)`` computed by Kiln vs ATen.  ``formulas`` are the FORMULAS keys it exercises;
    ``grad``: also compare the gradient of every floating input (inputs from ``grad_inputs``)."""

    name: str
    fn: Callable[..., Any]
    inputs: Callable[[], tuple]
    formulas: tuple[str, ...] = ()
    grad_inputs: Callable[[], tuple] | None = None
    rtol: float = 1.3e-6
    atol: float = 1e-5
    kernels: tuple[str, ...] = field(default_factory=tuple)  # kept-whole kernels it exercises


def _u(name: str, op: Any, formula: str, **kw: Any) -> Case:
    return Case(name, lambda x: op(x), lambda: (values(64),), (formula,), lambda: (smooth(),), **kw)


def _b(name: str, op: Any, formula: str, grad: bool = True, **kw: Any) -> Case:
    def gi() -> tuple:
        x = smooth()
        return x, x.flip(0) + 0.25

    return Case(name, lambda x, y: op(x, y), grid, (formula,), gi if grad else None, **kw)


CASES: list[Case] = [
    # --- binary arithmetic (with alpha), Tensor and Scalar overloads
    _b("add", aten.add.Tensor, "add.Tensor"),
    Case("add_alpha", lambda x, y: aten.add.Tensor(x, y, alpha=-2.5), grid, ("add.Tensor",)),
    Case(
        "add_scalar",
        lambda x: aten.add.Scalar(x, 1.5, alpha=2),
        lambda: (values(16),),
        ("add.Scalar",),
    ),  # fmt: skip
    _b("sub", aten.sub.Tensor, "sub.Tensor"),
    Case("sub_alpha", lambda x, y: aten.sub.Tensor(x, y, alpha=3), grid, ("sub.Tensor",)),
    Case(
        "sub_scalar",
        lambda x: aten.sub.Scalar(x, -0.5, alpha=0.5),
        lambda: (values(16),),
        ("sub.Scalar",),
    ),  # fmt: skip
    _b("mul", aten.mul.Tensor, "mul.Tensor"),
    Case("mul_scalar", lambda x: aten.mul.Scalar(x, -3.0), lambda: (values(16),), ("mul.Scalar",)),
    _b("div", aten.div.Tensor, "div.Tensor"),
    Case("div_scalar", lambda x: aten.div.Scalar(x, 7.0), lambda: (values(16),), ("div.Scalar",)),
    Case(
        "add_int",
        lambda x, y: aten.add.Tensor(x, y, alpha=2),
        lambda: (ints(), ints().flip(0)),
        ("add.Tensor",),
    ),  # fmt: skip
    Case(
        "mul_int",
        lambda x, y: aten.mul.Tensor(x, y),
        lambda: (ints(), ints().flip(0)),
        ("mul.Tensor",),
    ),  # fmt: skip
    # --- comparisons (Tensor and Scalar)
    *[
        Case(f"{c}", lambda x, y, c=c: getattr(aten, c).Tensor(x, y), grid, (f"{c}.Tensor",))
        for c in ("eq", "ne", "lt", "le", "gt", "ge")
    ],
    *[
        Case(
            f"{c}_scalar",
            lambda x, c=c: getattr(aten, c).Scalar(x, 0.5),
            lambda: (values(8),),
            (f"{c}.Scalar",),
        )  # fmt: skip
        for c in ("eq", "ne", "lt", "le", "gt", "ge")
    ],
    # --- logical / bitwise
    Case("logical_and", aten.logical_and.default, bools, ("logical_and.default",)),
    Case("logical_or", aten.logical_or.default, bools, ("logical_or.default",)),
    Case("logical_not", lambda a, b: aten.logical_not.default(a), bools, ("logical_not.default",)),
    Case("logical_and_float", aten.logical_and.default, grid, ("logical_and.default",)),
    Case(
        "bitwise_not_bool",
        lambda a, b: aten.bitwise_not.default(a),
        bools,
        ("bitwise_not.default",),
    ),  # fmt: skip
    Case(
        "bitwise_not_int",
        lambda x: aten.bitwise_not.default(x),
        lambda: (ints(),),
        ("bitwise_not.default",),
    ),  # fmt: skip
    # --- unary math
    _u("neg", aten.neg.default, "neg.default"),
    _u("abs", aten.abs.default, "abs.default"),
    Case("abs_int", aten.abs.default, lambda: (ints(),), ("abs.default",)),
    Case("neg_int", aten.neg.default, lambda: (ints(),), ("neg.default",)),
    _u("exp", aten.exp.default, "exp.default"),
    _u("expm1", aten.expm1.default, "expm1.default"),
    _u("log", aten.log.default, "log.default"),
    _u("log1p", aten.log1p.default, "log1p.default"),
    _u("log2", aten.log2.default, "log2.default"),
    _u("sqrt", aten.sqrt.default, "sqrt.default"),
    _u("rsqrt", aten.rsqrt.default, "rsqrt.default"),
    _u("reciprocal", aten.reciprocal.default, "reciprocal.default"),
    _u("sin", aten.sin.default, "sin.default"),
    _u("cos", aten.cos.default, "cos.default"),
    _u("tanh", aten.tanh.default, "tanh.default"),
    _u("erf", aten.erf.default, "erf.default"),
    _u("sigmoid", aten.sigmoid.default, "sigmoid.default"),
    _u("silu", aten.silu.default, "silu.default"),
    _u("relu", aten.relu.default, "relu.default"),
    _u("square", aten.square.default, "square.default"),
    _u("sign", aten.sign.default, "sign.default"),
    # --- pow: every special-cased exponent and the general one
    *[
        Case(
            f"pow_{e}",
            lambda x, e=e: aten.pow.Tensor_Scalar(x, e),
            lambda: (values(64),),
            ("pow.Tensor_Scalar",),
            lambda: (smooth().abs() + 0.5,),
        )  # fmt: skip
        for e in (2, 3, 0.5, -0.5, -1, -2, 1, 1.7, -3.5, 0)
    ],
    Case(
        "pow_scalar_base",
        lambda x: aten.pow.Scalar(2.5, x),
        lambda: (values(64),),
        ("pow.Scalar",),
        lambda: (smooth() / 4,),
    ),  # fmt: skip
    Case("pow_tensor", aten.pow.Tensor_Tensor, grid, ("pow.Tensor_Tensor",)),
    # --- min/max/clamp
    _b("maximum", aten.maximum.default, "maximum.default", grad=False),
    _b("minimum", aten.minimum.default, "minimum.default", grad=False),
    Case(
        "clamp_min",
        lambda x: aten.clamp_min.default(x, -0.5),
        lambda: (values(32),),
        ("clamp_min.default",),
        lambda: (smooth(),),
    ),  # fmt: skip
    Case(
        "clamp_max",
        lambda x: aten.clamp_max.default(x, 0.75),
        lambda: (values(32),),
        ("clamp_max.default",),
        lambda: (smooth(),),
    ),  # fmt: skip
    Case(
        "clamp",
        lambda x: aten.clamp.default(x, -1.0, 2.5),
        lambda: (values(32),),
        ("clamp.default",),
        lambda: (smooth(),),
    ),  # fmt: skip
    Case(
        "clamp_lo_only",
        lambda x: aten.clamp.default(x, -1.0),
        lambda: (values(32),),
        ("clamp.default",),
    ),  # fmt: skip
    Case(
        "clamp_hi_only",
        lambda x: aten.clamp.default(x, None, 2.0),
        lambda: (values(32),),
        ("clamp.default",),
    ),  # fmt: skip
    # --- GELU, both approximations, forward and backward
    # ATen's vectorized GELU (erf form) overflows in an intermediate: gelu(3e38) = inf and
    # gelu(inf) = NaN there, where Kiln returns 3e38 and inf (the exact values); compared on
    # |x| <= 1e20.
    Case(
        "gelu",
        lambda x: aten.gelu.default(x),
        lambda: (torch.cat([finite(), values(64)[N:]]),),
        ("gelu.default",),
        lambda: (smooth(),),
    ),  # fmt: skip
    Case(
        "gelu_tanh",
        lambda x: aten.gelu.default(x, approximate="tanh"),
        lambda: (values(64),),
        ("gelu.default",),
        lambda: (smooth(),),
    ),  # fmt: skip
    Case(
        "gelu_backward",
        lambda g, x: aten.gelu_backward.default(g, x),
        grad_grid,
        ("gelu_backward.default",),
    ),  # fmt: skip
    Case(
        "gelu_backward_tanh",
        lambda g, x: aten.gelu_backward.default(g, x, approximate="tanh"),
        grad_grid,
        ("gelu_backward.default",),
        rtol=1e-5,
    ),  # fmt: skip
    Case(
        "gelu_backward_smooth",
        lambda g, x: aten.gelu_backward.default(g, x),
        lambda: (smooth() * 0 + 1.5, smooth()),
        ("gelu_backward.default",),
    ),  # fmt: skip
    Case(
        "gelu_backward_tanh_smooth",
        lambda g, x: aten.gelu_backward.default(g, x, approximate="tanh"),
        lambda: (smooth() * 0 + 1.5, smooth()),
        ("gelu_backward.default",),
    ),  # fmt: skip
    # --- select / fill
    Case(
        "where",
        lambda c, x, y: aten.where.self(c, x, y),
        lambda: (grid()[0] > grid()[1], *grid()),
        ("where.self",),
    ),  # fmt: skip
    Case(
        "masked_fill_scalar",
        lambda x, m: aten.masked_fill.Scalar(x, m, float("-inf")),
        lambda: (grid()[0], grid()[1] > 0),
        ("masked_fill.Scalar",),
    ),  # fmt: skip
    Case(
        "masked_fill_tensor",
        lambda x, m, v: aten.masked_fill.Tensor(x, m, v),
        lambda: (grid()[0], grid()[1] > 0, torch.tensor(-2.5)),
        ("masked_fill.Tensor",),
    ),  # fmt: skip
    # --- activation backward formulas
    Case(
        "sigmoid_backward",
        aten.sigmoid_backward.default,
        lambda: (grid()[0], torch.sigmoid(grid()[1])),
        ("sigmoid_backward.default",),
    ),  # fmt: skip
    Case(
        "tanh_backward",
        aten.tanh_backward.default,
        lambda: (grid()[0], torch.tanh(grid()[1])),
        ("tanh_backward.default",),
    ),  # fmt: skip
    Case(
        "threshold_backward",
        lambda g, x: aten.threshold_backward.default(g, x, 0.0),
        grid,
        ("threshold_backward.default",),
    ),  # fmt: skip
    Case(
        "threshold_backward_nonzero",
        lambda g, x: aten.threshold_backward.default(g, x, 0.5),
        grid,
        ("threshold_backward.default",),
    ),  # fmt: skip
    Case("silu_backward", aten.silu_backward.default, grid, ("silu_backward.default",)),
    # --- ternary
    # Kiln computes a true fused multiply-add; ATen's prims.fma reference rounds a * b first, so
    # where a * b overflows (-3e38 * 2.5 + inf) ATen gives NaN and Kiln inf: compared where the
    # product is finite.
    Case(
        "fma",
        lambda a, b, c: prims.fma.default(a, b, c),
        lambda: _fma_inputs(),
        ("fma.default",),
    ),  # fmt: skip
    Case(
        "addcmul",
        lambda x, a, b: aten.addcmul.default(x, a, b, value=-0.5),
        lambda: (grid()[1].flip(0), *grid()),
        ("addcmul.default",),
    ),  # fmt: skip
    Case(
        "addcdiv",
        lambda x, a, b: aten.addcdiv.default(x, a, b, value=2.0),
        lambda: (grid()[1].flip(0), *grid()),
        ("addcdiv.default",),
    ),  # fmt: skip
    Case("lerp_scalar_lo", lambda x, e: aten.lerp.Scalar(x, e, 0.25), grid, ("lerp.Scalar",)),
    Case("lerp_scalar_hi", lambda x, e: aten.lerp.Scalar(x, e, 0.75), grid, ("lerp.Scalar",)),
    Case(
        "lerp_tensor",
        lambda x, e, w: aten.lerp.Tensor(x, e, w),
        lambda: (*grid(), torch.linspace(-1.5, 2.5, N * N)),
        ("lerp.Tensor",),
    ),  # fmt: skip
    # --- copies and casts
    Case("copy", lambda x, y: aten.copy.default(x, y), grid, ("copy.default",)),
    Case("clone", lambda x: aten.clone.default(x) * 1.0, lambda: (values(8),), ("clone.default",)),
    Case(
        "to_int",
        lambda x: aten._to_copy.default(x, dtype=torch.int64),
        lambda: (torch.tensor([-3.7, -0.5, 0.0, 0.5, 2.9, 1e6]),),
        ("_to_copy.default",),
    ),  # fmt: skip
    Case(
        "to_bool",
        lambda x: aten._to_copy.default(x, dtype=torch.bool),
        lambda: (values(8),),
        ("_to_copy.default",),
    ),  # fmt: skip
    Case(
        "to_float",
        lambda x: aten._to_copy.default(x, dtype=torch.float32) * 0.5,
        lambda: (ints(),),
        ("_to_copy.default",),
    ),  # fmt: skip
    Case("alias", lambda x: aten.alias.default(x) + 1.0, lambda: (values(8),), ("alias.default",)),
]

# Kept-whole kernels and row reductions: (log_)softmax forward/backward in a row kernel, layer
# norm forward/backward, row/column sums, mean, amax.
_rows = lambda: (torch.cat([special()[3:-3].clamp(-80, 80), torch.zeros(3)]).reshape(3, 10),)  # noqa: E731


def _matrix(r: int = 6, c: int = 37) -> tuple:
    g = torch.Generator().manual_seed(11)
    return (torch.randn(r, c, generator=g) * 4,)


def _randn(*shape: int, seed: int = 13) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


KERNEL_CASES: list[Case] = [
    Case(
        "softmax",
        lambda x: torch.softmax(x, -1),
        _matrix,
        (),
        _matrix,
        kernels=("_softmax", "_softmax_backward_data"),
    ),  # fmt: skip
    Case(
        "log_softmax",
        lambda x: torch.log_softmax(x, -1),
        _matrix,
        (),
        _matrix,
        kernels=("_log_softmax", "_log_softmax_backward_data"),
    ),  # fmt: skip
    Case("softmax_extreme", lambda x: torch.softmax(x, -1), _rows, ()),
    Case(
        "softmax_masked",
        lambda x: torch.softmax(x.masked_fill(x < 0, float("-inf")), -1),
        _matrix,
        (),
    ),  # fmt: skip
    Case(
        "layer_norm",
        lambda x, w, b: torch.nn.functional.layer_norm(x, (37,), w, b, 1e-5),
        lambda: (*_matrix(), _randn(37), _randn(37, seed=14)),
        (),
        lambda: (*_matrix(), _randn(37), _randn(37, seed=14)),
        kernels=("native_layer_norm", "native_layer_norm_backward"),
    ),  # fmt: skip
    Case(
        "layer_norm_big_mean",
        lambda x: torch.nn.functional.layer_norm(x + 1e3, (37,)),
        _matrix,
        (),
        _matrix,
        rtol=1e-4,
        atol=1e-4,
    ),  # fmt: skip
    Case("row_sum_mean_amax", lambda x: (x.sum(-1), x.mean(-1), x.amax(-1)), _matrix, ()),
    Case("col_sum", lambda x: (x * 2).sum(0), _matrix, ()),
    Case(
        "row_reduce_special",
        lambda x: (x.sum(-1), x.amax(-1), x.mean(-1)),
        lambda: (special()[:-1].reshape(4, 8),),
        (),
    ),  # fmt: skip
    Case(
        "gelu_mlp",
        lambda x, w: torch.nn.functional.gelu(x @ w, approximate="tanh").sum(-1),
        lambda: (*_matrix(), _randn(37, 5)),
        (),
        lambda: (*_matrix(), _randn(37, 5)),
    ),  # fmt: skip
]
