"""Generated kernels against eager on edge values: integer overflow, signs, NaN, infinities.

OpInfo samples are random values of moderate size; these are the values where C++ and ATen can
part ways: integer powers past 2^53 and past the type's range (ATen wraps; Kiln computed them
through double, so 3**39 lost its low digits and an overflow gave INT64_MIN), the sign
conventions of floor division and remainders, NaN through minimum/maximum/clamp, log-softmax
over large logits (computed as x - (max + log(sum)), the sum rounded to the logits' magnitude:
logits of 1e5 lost 2e-3, of 1e3 3e-5, of 1e38 everything; ATen subtracts the max first).  Each op runs
whole-tensor through the compile backend and on the lazy device (both end in Kiln's kernels);
integer results must be equal, float results equal up to rounding (NaN where eager has NaN).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import kiln

INF, NAN = float("inf"), float("nan")
FLOATS = [NAN, INF, -INF, 0.0, -0.0, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 7.0, -7.0, 1e-8, 3.4e38]
INT64 = [-(2**63), -(2**31), -7, -3, -1, 0, 1, 2, 3, 7, 39, 2**31, 2**63 - 1]


def _grid(vals: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = list(itertools.product(vals, vals))
    if not dtype.is_floating_point:  # INT_MIN // -1 traps (SIGFPE) in eager PyTorch too
        pairs = [(x, y) for x, y in pairs if not (x == min(vals) and y == -1)]
    a, b = zip(*pairs)
    return torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)


def _pow_args() -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor([3, -3, 7, -(2**63), 2**31, 5, 1, -1, -1, 0, 2, 12345, -7, 2**63 - 1])
    b = torch.tensor([39, 39, 22, 2, 3, 0, -5, -5, -4, 0, 63, 5, 3, 2])
    return a, b


CASES: dict[str, tuple[Callable, Callable[[], tuple]]] = {
    "pow_int_tensor": (torch.pow, _pow_args),
    "pow_int_scalar_exponent": (lambda a, b: a**39 + b, _pow_args),
    "pow_int_scalar_base": (lambda a, b: 3 ** b.clamp(min=0) + a, _pow_args),
    "pow_int32": (lambda a, b: torch.pow(a.to(torch.int32), b.to(torch.int32)), _pow_args),
    "floor_divide_int": (torch.floor_divide, lambda: _grid([v for v in INT64 if v], torch.int64)),
    "remainder_int": (torch.remainder, lambda: _grid([v for v in INT64 if v], torch.int64)),
    "fmod_int": (torch.fmod, lambda: _grid([v for v in INT64 if v], torch.int64)),
    "div_trunc_int": (
        lambda a, b: torch.div(a, b, rounding_mode="trunc"),
        lambda: _grid([v for v in INT64 if v], torch.int64),
    ),
    "floor_divide_float": (torch.floor_divide, lambda: _grid(FLOATS, torch.float32)),
    "remainder_float": (torch.remainder, lambda: _grid(FLOATS, torch.float32)),
    "fmod_float": (torch.fmod, lambda: _grid(FLOATS, torch.float32)),
    "minimum_maximum_nan": (
        lambda a, b: torch.stack([torch.minimum(a, b), torch.maximum(a, b)]),
        lambda: _grid(FLOATS, torch.float32),
    ),
    "clamp_nan": (
        lambda a, b: torch.stack([a.clamp(-1.0, 1.0), a.clamp(min=b), a.clamp(max=b)]),
        lambda: _grid(FLOATS, torch.float32),
    ),
    "log_softmax_large_logits": (
        lambda x: torch.stack([torch.log_softmax(x, -1), torch.softmax(x, -1)]),
        lambda: (
            torch.tensor(
                [[3.4e38] * 4, [1e5, 1e5 + 0.5, 1e5 + 1.0, 1e5 - 2.0], [-3e4, -3e4 + 1, -3e4, 0.0]]
            ),
        ),
    ),
    "pow_int_empty_and_transposed": (
        lambda a, b: torch.cat([torch.pow(a, b).flatten(), (a.t() ** 3).flatten()]),
        lambda: (torch.arange(-6, 6).view(3, 4).t()[:, :0], torch.ones(4, 0, dtype=torch.long)),
    ),
    "pow_int_transposed": (
        lambda a, b: torch.pow(a, b),
        lambda: (torch.arange(-6, 6).view(3, 4).t() * 1000, torch.arange(12).view(4, 3) % 7),
    ),
    "log_softmax_empty_and_transposed": (
        lambda x, y: torch.cat(
            [torch.log_softmax(x, -1).flatten(), torch.log_softmax(y, -1).flatten()]
        ),
        lambda: (torch.randn(0, 5), (torch.randn(7, 3) * 1e4).t()),
    ),
    "shifts_int": (
        lambda a, b: torch.stack([a << b.clamp(0, 62), a >> b.clamp(0, 62)]),
        lambda: _grid([v for v in INT64 if abs(v) < 2**40], torch.int64),
    ),
}


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=0.0, equal_nan=True)
    else:
        bad = (got != want).nonzero().flatten().tolist()
        assert not bad, (
            f"differ at {bad[:8]}: kiln {got[bad[:8]].tolist()}, eager {want[bad[:8]].tolist()}"
        )


@pytest.mark.parametrize("name", list(CASES))
def test_compile_backend_matches_eager(name: str) -> None:
    fn, make = CASES[name]
    args = make()
    want = fn(*args)
    torch._dynamo.reset()
    _same(torch.compile(fn, backend="kiln", dynamic=False)(*args), want)


@pytest.mark.parametrize("name", list(CASES))
def test_lazy_device_matches_eager(name: str) -> None:
    fn, make = CASES[name]
    args = make()
    want = fn(*args)
    dev = kiln.device()
    got = fn(*(a.to(dev) for a in args))
    kiln.mark_step()
    _same(got.cpu(), want)
