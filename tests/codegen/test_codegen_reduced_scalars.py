"""bfloat16 / float16 ops with numbers mixed in, bit for bit against eager.

ATen casts a Python number, a 0-dim float32 tensor or an int64 tensor to a bf16 / fp16 op's dtype
before the op (``bf16 + 0.1`` adds 0.10009765625; ``alpha`` and ``pow``'s exponent likewise), except
where a kernel reads a one-element second operand in float (``mul``, true ``div``); Kiln's kernels
computed with the number as given and rounded once: 1-4% of the elements of ``x + 0.1234567``
one ulp off, half of ``x ** 1.7``, and ``x == 0.1`` false where eager's is true
(:mod:`kiln.codegen.cpp.scalars`).  Every case must equal eager exactly, in both modes.  The
tensors hold 4096 elements, a multiple of every vector width: ATen computes a loop's scalar tail
(and non-contiguous inputs) of ``add`` with ``alpha`` in another order, which Kiln does not copy.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kiln

S = 0.1234567  # not a bf16 / fp16 number: the rounded one differs
N = 4096


def _args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, generator=g) * 3).to(dtype)
    x[:64] = torch.tensor(S, dtype=torch.float32).to(
        dtype
    )  # where == / <= / != tell the roundings apart
    x[64:70] = torch.tensor([float("-inf"), float("inf"), -0.0, 0.0, float("nan"), -1.0])
    y = torch.randn(N, generator=g).to(dtype)
    z = (torch.randn(N, generator=g).abs() + 0.5).to(dtype)
    ints = torch.randint(-3000, 3000, (N,), generator=g)
    return x, y, z, ints


T0 = torch.tensor(S)  # a 0-dim float32 tensor: mixed into a bf16 op, cast to bf16 first

CASES: dict[str, Callable[..., torch.Tensor]] = {
    "add_scalar": lambda x, y, z, i: x + S,
    "sub_scalar": lambda x, y, z, i: x - S,
    "rsub_scalar": lambda x, y, z, i: S - x,
    "add_int_scalar": lambda x, y, z, i: x + 1001,
    "add_alpha": lambda x, y, z, i: torch.add(x, y, alpha=0.3712345),
    "sub_alpha": lambda x, y, z, i: torch.sub(x, y, alpha=0.3712345),
    "add_scalar_alpha": lambda x, y, z, i: torch.add(x, S, alpha=0.3712345),
    "add_0dim_float32": lambda x, y, z, i: x + T0.to(x.device),
    "add_int64_tensor": lambda x, y, z, i: x + i,
    "mul_scalar": lambda x, y, z, i: x * S,
    "div_scalar": lambda x, y, z, i: x / S,
    "mul_0dim_first": lambda x, y, z, i: torch.mul(T0.to(x.device), x),
    "rdiv_scalar": lambda x, y, z, i: S / z,
    "compare_scalar": lambda x, y, z, i: torch.stack(
        [x == S, x != S, x <= S, x < S, x >= S, x > S]
    ),
    "maximum_0dim": lambda x, y, z, i: torch.maximum(x, T0.to(x.device)),
    "pow_scalar": lambda x, y, z, i: x.abs() ** 1.7,
    "pow_rounds_to_two": lambda x, y, z, i: x**2.004,
    "pow_special": lambda x, y, z, i: torch.stack(
        [x**2, x**3, x**-2, x**0.5, x**-0.5, x**-1, x**1.0]
    ),
    "pow_scalar_base": lambda x, y, z, i: 1.3**y,
    "chain": lambda x, y, z, i: (x * S + y) * 0.3712345 - z,
    "addcmul_addcdiv": lambda x, y, z, i: torch.stack(
        [torch.addcmul(x, y, z, value=0.3), x.addcdiv(y, z, value=0.3)]
    ),
    "transposed_add_scalar": lambda x, y, z, i: x.view(64, 64).t() + S,
}


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    bad = (got != want) & ~(got.isnan() & want.isnan()) if want.is_floating_point() else got != want
    idx = bad.flatten().nonzero().flatten()[:6].tolist()
    assert not idx, (
        f"{int(bad.sum())} of {want.numel()} differ, e.g. at {idx}: kiln "
        f"{got.flatten()[idx].tolist()}, eager {want.flatten()[idx].tolist()}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_compile_backend_matches_eager_bits(name: str, dtype: torch.dtype) -> None:
    args = _args(dtype)
    want = CASES[name](*args)
    torch._dynamo.reset()
    _same(torch.compile(CASES[name], backend="kiln", dynamic=False)(*args), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_lazy_device_matches_eager_bits(name: str, dtype: torch.dtype) -> None:
    args = _args(dtype)
    want = CASES[name](*args)
    dev = kiln.device()
    got = CASES[name](*(a.to(dev) for a in args))
    kiln.mark_step()
    _same(got.cpu(), want)


def test_zero_size_and_scalar_only_inputs() -> None:
    """Nothing to round on an empty tensor; a 0-dim bf16 tensor with a number is still bf16."""
    e = torch.empty(0, 3, dtype=torch.bfloat16)
    s = torch.tensor(1.5, dtype=torch.bfloat16)

    def f(e: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return e + S, (s + S) * 2.004

    want = f(e, s)
    torch._dynamo.reset()
    got = torch.compile(f, backend="kiln", dynamic=False)(e, s)
    for g, w in zip(got, want):
        _same(g, w)
