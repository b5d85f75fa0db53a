"""Zero-size dims, size-1 dims and NaNs are part of every generated kernel's contract.

A kernel that iterates over nothing must still write its reduction outputs when only the reduced
dims are empty: the bias gradient of a linear layer over an empty batch was uninitialized memory
(1.9e38) because the column-sum kernel returned before writing.  Forward values and gradients are
compared with eager, NaN where eager gives NaN (a mean over nothing).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln  # noqa: F401 - registers the backend
from kiln_codegen_testlib import cpp_only, poison_outputs


def _run(fn, xs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*xs)
    cot = torch.ones_like(out)
    gs = torch.autograd.grad(out, [x for x in xs if x.requires_grad], cot, allow_unused=True)
    return out.detach(), gs


CASES = {
    "linear_empty_batch": (
        lambda x, w, b: F.linear(x, w, b) * 2.0,
        [(0, 5), (3, 5), (3,)],
    ),
    "bilinear_empty_batch": (
        lambda x1, x2, w, b: F.bilinear(x1, x2, w, b),
        [(0, 4), (0, 3), (2, 4, 3), (2,)],
    ),
    "layer_norm_empty_batch": (
        lambda x, w, b: F.layer_norm(x * 2.0, (5,), w, b),
        [(0, 5), (5,), (5,)],
    ),
    "col_sum_zero_rows": (lambda x, b: (x * 3.0).sum(0) * b, [(0, 7), (7,)]),
    "row_mean_zero_len": (lambda x: (x * 3.0).mean(-1), [(4, 0)]),
    "row_sum_zero_len": (lambda x: (x + 1.0).sum(-1, keepdim=True), [(2, 3, 0)]),
    "broadcast_bias_zero_batch": (lambda x, b: (x * b).sum((0, 1)), [(0, 3, 4), (4,)]),
    # found by the fuzzer: the row kernel's max reduction dropped NaNs (ATen's amax keeps them)
    "amax_nan": (lambda x: torch.amax(x * 2.0, -1), [(3, 5)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_size_matches_eager(name, monkeypatch):
    poison_outputs(monkeypatch)
    torch.manual_seed(0)
    fn, shapes = CASES[name]
    xs = [torch.randn(s) for s in shapes]
    if name == "amax_nan":
        xs[0][1, 2] = float("nan")
    torch._dynamo.reset()
    eo, eg = _run(fn, xs)
    ko, kg = _run(torch.compile(fn, backend="kiln"), xs)
    torch.testing.assert_close(ko, eo, equal_nan=True)
    assert len(kg) == len(eg)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, equal_nan=True)


@cpp_only
def test_layer_norm_one_element_gradient_is_exact(monkeypatch):
    """Found by the fuzzer: over one element, x - mean == 0 and rstd = 1/sqrt(eps) ~ 316, so any
    rounding in the backward is multiplied by 316.  Kiln ran ATen's backward on its own rstd
    (the kernel did not take (rows, 1) statistics) and was 1.5e-5 off; its kernel now takes them
    and, computing dy * w - mean(dy * w) in double, gives the exact gradient: 0 for x."""
    poison_outputs(monkeypatch)
    torch.manual_seed(0)
    xs = [torch.randn(5, 1), torch.randn(1), torch.randn(1)]

    def fn(x, w, b):
        return F.layer_norm(x, (1,), w, b)

    torch._dynamo.reset()
    _, kg = _run(torch.compile(fn, backend="kiln"), xs)
    x64 = [x.double() for x in xs]
    _, rg = _run(fn, x64)
    assert torch.equal(kg[0], torch.zeros(5, 1)), kg[0]
    torch.testing.assert_close(kg[1], rg[1].float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kg[2], rg[2].float())
