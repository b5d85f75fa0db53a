"""Stochastic rounding kernels: unbiased, only the two neighbours, reproducible, special values."""

from __future__ import annotations

import pytest
import torch

from kiln.precision import manual_seed, round_nearest, stochastic_round

REPS = 100_000


def _values() -> torch.Tensor:
    torch.manual_seed(0)
    vals = [
        *(torch.rand(12) * 100).tolist(),
        *(-torch.rand(6) * 7).tolist(),
        1.0 + 2**-9,  # exactly half way between two bf16 values
        -(1.0 + 3 * 2**-10),
        1e-3,
        -2.5e-7,
        3.14159e-20,
        1e-38,  # fp32 normal, below bf16's smallest normal
        5e-40,  # fp32 subnormal
        -7.3e-42,
        2.0**-133,  # bf16's smallest subnormal
        3.3e38,  # near bf16's max
        -3.2e38,
        65000.0,
        0.1,
        -0.3,
        1.0,  # exactly representable: never changes
        0.0,
    ]
    return torch.tensor(vals, dtype=torch.float32)


def _neighbours(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Every y is x truncated toward zero to bf16, or the next bf16 away from zero."""
    low = (x.view(torch.int32) >> 16).to(torch.int32)
    got = y.view(torch.int16).to(torch.int32)
    return bool(((got - low == 0) | (got - low == 1)).all())


def test_sr_bf16_unbiased_and_neighbours():
    x = _values()
    assert len(x) >= 32
    xs = x.repeat(REPS, 1)  # every value rounded REPS times, each with its own random bits
    y = stochastic_round(xs, key=12345)
    assert _neighbours(xs, y)
    mean = y.double().mean(0)
    tol = 3e-5 + 3e-5 * x.double().abs()
    err = (mean - x.double()).abs()
    assert bool((err <= tol).all()), f"biased at {x[err > tol].tolist()}: {err[err > tol].tolist()}"
    # both neighbours are used where x is not representable
    inexact = x.bfloat16().float() != x
    ups = (y.float().abs() > xs.abs()).double().mean(0)
    assert bool((ups[inexact] > 0).all()) and bool((ups[~inexact] == 0).all())


def test_sr_bf16_same_seed_same_bits():
    x = torch.randn(4099) * 10
    assert torch.equal(
        stochastic_round(x, key=7).view(torch.int16), stochastic_round(x, key=7).view(torch.int16)
    )
    assert not torch.equal(stochastic_round(x, key=7), stochastic_round(x, key=8))
    manual_seed(3)
    a = [stochastic_round(x).view(torch.int16) for _ in range(3)]
    manual_seed(3)
    b = [stochastic_round(x).view(torch.int16) for _ in range(3)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], a[1])  # the step advances


def test_sr_bf16_special_values():
    bits = torch.tensor([0x7F800001, 0xFF800001 - 2**32, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int32)
    nans = bits.view(torch.float32).repeat(1000)
    assert bool(stochastic_round(nans).float().isnan().all())  # the bit trick alone gives inf
    special = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0]).repeat(1000)
    y = stochastic_round(special)
    assert torch.equal(y.view(torch.int16), special.bfloat16().view(torch.int16))
    # above bf16's max: rounds to max or to inf, as the format's next step up is inf
    big = torch.full((10000,), 3.4e38)
    y = stochastic_round(big).float()
    bmax = torch.finfo(torch.bfloat16).max
    assert bool(((y == bmax) | (y == float("inf"))).all()) and 0 < (y == bmax).sum() < 10000
    assert bool((stochastic_round(-big).float() <= -bmax).all())


def test_round_nearest_matches_torch():
    torch.manual_seed(1)
    x = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, torch.randn(1 << 16), torch.tensor([65519.0, 65520.0, 3.4e38, -0.0])])
    ok = ~x.isnan()
    for dt in (torch.bfloat16, torch.float16):
        y = round_nearest(x, dt)
        assert torch.equal(y[ok].view(torch.int16), x[ok].to(dt).view(torch.int16))
        assert bool(y[~ok].isnan().all())


def test_sr_fp16_unbiased_and_overflow():
    x = torch.tensor([1.0 + 2**-12, -3.3e-3, 1e-6, 6e-8, -1e-7, 60000.0, 0.1, 2.0**-24, 1.0])
    xs = x.repeat(REPS, 1)
    y = stochastic_round(xs, torch.float16, key=99).double()
    err = (y.mean(0) - x.double()).abs()
    assert bool((err <= 3e-5 * (1 + x.double().abs())).all()), err
    lo = xs.half().double()  # each output is one of the two fp16 neighbours
    gap = torch.nextafter(lo.abs().float().half(), torch.tensor(70000.0).half()).double() - lo.abs()
    assert bool(((y - xs.double()).abs() <= gap + 1e-12).all())
    y = stochastic_round(torch.full((1000,), 65519.0), torch.float16).float()
    assert bool(((y == 65504.0) | (y == float("inf"))).all())
    nan = stochastic_round(torch.tensor([float("nan"), float("inf")]), torch.float16)
    assert nan[0].isnan() and nan[1] == float("inf")


def test_sr_does_not_stall():
    """bf16 1.0 + 1e-3, 1,000 times: round-to-nearest stays at 1.0, SR reaches 2.0 on average."""
    chains = 10_000
    w_rne = torch.ones(chains, dtype=torch.bfloat16)
    w_sr = torch.ones(chains, dtype=torch.bfloat16)
    manual_seed(0)
    for _ in range(1000):
        w_rne = round_nearest(w_rne.float() + 1e-3)
        w_sr = stochastic_round(w_sr.float() + 1e-3)
    assert bool((w_rne == 1.0).all())
    assert abs(w_sr.double().mean().item() - 2.0) <= 0.01


@pytest.mark.parametrize("shape", [(0,), (3, 0), (5, 7)])
def test_sr_shapes_and_errors(shape):
    x = torch.randn(shape)
    assert stochastic_round(x).shape == x.shape
    nc = torch.randn(8, 6).t()
    assert torch.equal(stochastic_round(nc, key=1), stochastic_round(nc.contiguous(), key=1))
    with pytest.raises(TypeError, match="float32"):
        stochastic_round(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16"):
        stochastic_round(torch.ones(3), torch.int8)
