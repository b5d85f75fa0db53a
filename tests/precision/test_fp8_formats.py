"""fp8 formats: bit-exact against torch's float8 dtypes, saturation, bias shifts, SR."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.precision import E3M4, E4M3, E4M3_FNUZ, E5M2, E5M2_FNUZ, FormatError, dequantize, quantize
from kiln.precision.formats import fp8_format

TORCH_FORMATS = [E4M3, E5M2, E4M3_FNUZ, E5M2_FNUZ]
# torch's own overflow behaviour: e4m3fn saturates, the others give inf / NaN
TORCH_SATURATES = {"e4m3": True, "e5m2": False, "e4m3fnuz": False, "e5m2fnuz": False}


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31 - 1, (1 << 19,), dtype=torch.int32, generator=g)
    wide = raw.view(torch.float32)  # every exponent, NaNs and infs included
    # the fp8 range and just beyond it, where rounding and overflow decide the code
    mag = torch.exp2(torch.rand(1 << 19, generator=g) * 40 - 22)
    near = mag * torch.where(torch.rand(1 << 19, generator=g) < 0.5, -1.0, 1.0)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            448.0,
            464.0,
            480.0,
            57344.0,
            61440.0,
            240.0,
            248.0,
            2.0**-9,
            2.0**-10,
            1.5 * 2.0**-10,
            2.0**-17,
        ]
    )
    x = torch.cat([wide, near, special])
    assert x.numel() >= 1 << 20
    return x


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_all_codes_decode_like_torch(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(fmt.torch_dtype).float()
    ours = dequantize(codes, fmt)
    assert torch.equal(ours.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(ours[ok].view(torch.int32), ref[ok].view(torch.int32))  # -0.0 too
    fin = ours.isfinite()
    assert ours[fin].abs().max().item() == fmt.max
    # every code but NaN encodes back to itself
    back = quantize(ours[ok], fmt, saturate=TORCH_SATURATES[fmt.name])
    assert torch.equal(back, codes[ok])


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_quantize_bit_exact_against_torch(fmt):
    x = _inputs()
    ours = quantize(x, fmt, saturate=TORCH_SATURATES[fmt.name])
    ref = x.to(fmt.torch_dtype).view(torch.uint8)
    nan = x.isnan()
    assert torch.equal(ours[~nan], ref[~nan]), x[~nan][ours[~nan] != ref[~nan]][:8]
    assert bool(dequantize(ours[nan], fmt).isnan().all())


def test_saturation_is_explicit():
    big = torch.tensor([1e9, -1e9, math.inf, -math.inf, 500.0])
    assert dequantize(quantize(big, E5M2, saturate=True), E5M2).tolist() == [
        57344.0, -57344.0, 57344.0, -57344.0, 512.0]  # fmt: skip
    assert dequantize(quantize(big, E5M2, saturate=False), E5M2)[:4].tolist() == [
        math.inf, -math.inf, math.inf, -math.inf]  # fmt: skip
    sat = dequantize(quantize(big, E4M3, saturate=True), E4M3)
    assert sat.tolist() == [448.0, -448.0, 448.0, -448.0, 448.0]
    assert bool(dequantize(quantize(big, E4M3, saturate=False), E4M3).isnan().all())  # no inf
    assert bool(dequantize(quantize(big, E4M3_FNUZ, saturate=False), E4M3_FNUZ).isnan().all())
    assert dequantize(quantize(big, E4M3_FNUZ), E4M3_FNUZ)[:2].tolist() == [240.0, -240.0]
    # fnuz has no negative zero: -0.0 and tiny negatives encode as 0, never as the NaN code 0x80
    assert quantize(torch.tensor([-0.0, -1e-30]), E4M3_FNUZ).tolist() == [0, 0]


def test_e3m4_format():
    assert (E3M4.max, E3M4.min_normal, E3M4.min_subnormal) == (30.0, 0.25, 2.0**-6)
    vals = E3M4.table
    assert int(vals.isnan().sum()) == 2 and not bool(vals.isinf().any())
    x = torch.tensor([0.3, 31.0, -100.0, 0.01, 2.0**-7, 3 * 2.0**-7])
    # 0.3 -> 0.296875 (1.0011b * 2^-2); 31 and -100 saturate; 2^-7 is a tie -> even (0);
    # 3*2^-7 is a tie between 2^-6 and 2^-5 -> even mantissa (2^-5)
    assert dequantize(quantize(x, E3M4), E3M4).tolist() == [
        0.296875,
        30.0,
        -30.0,
        0.015625,
        0.0,
        0.03125,
    ]


@pytest.mark.parametrize("base", [E4M3, E5M2, E3M4, E4M3_FNUZ], ids=lambda f: f.name)
@pytest.mark.parametrize("k", [-3, 2, 5])
def test_bias_shift_equals_power_of_two_scale(base, k):
    shifted = base.with_bias(base.bias + k)
    assert torch.equal(shifted.table[~shifted.table.isnan()],
                       (base.table * 2.0**-k)[~base.table.isnan()])  # fmt: skip
    x = torch.randn(1 << 16) * torch.exp2(torch.randint(-12, 12, (1 << 16,)).float())
    assert torch.equal(quantize(x, shifted), quantize(x * 2.0**k, base))
    assert torch.equal(quantize(x, shifted), quantize(x, base, 2.0**k))
    assert torch.equal(dequantize(quantize(x, shifted), shifted),
                       dequantize(quantize(x, base, 2.0**k), base, 2.0**k))  # fmt: skip


def test_bias_validation():
    with pytest.raises(FormatError, match="bias"):
        E5M2.with_bias(200)
    with pytest.raises(FormatError, match="unknown fp8 format"):
        fp8_format("e2m5")
    assert fp8_format("e4m3", 9).max == 448.0 / 4


def test_sr_quantize_unbiased():
    x = torch.tensor([0.3, -1.1, 100.0, 0.004, -200.0, 3e-3])
    xs = x.repeat(100_000, 1)
    q = dequantize(quantize(xs, E4M3, rounding_mode="sr", key=5), E4M3)
    lo = dequantize(quantize(xs, E4M3), E4M3)  # one of the two neighbours around x
    assert bool(((q - lo).abs() <= (0.125 * xs.abs()).clamp_min(2.0**-9) + 1e-9).all())
    gap = torch.tensor([2.0**-5, 2.0**-3, 8.0, 2.0**-9, 16.0, 2.0**-9])
    err = (q.double().mean(0) - x.double()).abs()
    assert bool((err < 5 * gap.double() * 0.5 / 316).all()), err  # 5 sigma of the mean
    again = quantize(xs[:4], E4M3, rounding_mode="sr", key=5)
    assert torch.equal(again, quantize(xs[:4], E4M3, rounding_mode="sr", key=5))


def test_per_row_scale_and_errors():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    s = torch.tensor([1.0, 2.0, 4.0, 8.0])
    q = quantize(x, E4M3, s)
    for r in range(4):
        assert torch.equal(q[r], quantize(x[r : r + 1], E4M3, float(s[r]))[0])
    # each row is x * s rounded by torch's own e4m3 cast, then divided by s again
    want = (x * s[:, None]).to(torch.float8_e4m3fn).float() / s[:, None]
    assert torch.equal(dequantize(q, E4M3, s), want)
    # error bound: half an ulp (2^-4 relative) in the normal range, half the subnormal step
    # (2^-10, divided by the row's scale) below it
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 / s[:, None])
    assert bool(((dequantize(q, E4M3, s) - x).abs() <= bound).all())
    with pytest.raises(ValueError, match="one per row"):
        quantize(x, E4M3, torch.ones(3))
    with pytest.raises(ValueError, match="rounding_mode"):
        quantize(x, E4M3, rounding_mode="up")
    assert quantize(torch.empty(0, 5), E4M3).shape == (0, 5)
