"""Graphs with symbolic sizes that compute numbers from them (``x.size(-1) ** 0.5``), and the dtype
casts torch's decompositions leave as ``prims.convert_element_type``, compiled by Kiln.

Dynamo traces ``x.size(1) ** 0.5`` of a dynamic size as ``torch.sym_float`` then ``pow``; Kiln
computed the builtin arithmetic but not torch's ``sym_*`` functions, so the whole graph ran on ATen
(a ``graph:call to <function sym_float ...> is not an ATen op`` fallback).  Gemma 2 compiled after
another model in the same process (Dynamo's automatic dynamic shapes) left
``prims.convert_element_type`` of 0-dim float64 tensors, each an ATen fallback; it is the dtype
cast Kiln lowers (``_to_copy``).  Each case: values and gradients against eager over several
sizes, and no fallback."""

from __future__ import annotations

import math

import pytest
import torch

import kiln


def _fallbacks() -> dict:
    return kiln.metrics.counters()["fallbacks"]


def test_scale_from_a_symbolic_size_compiles_with_gradients() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        scale = x.size(-1) ** -0.5  # sym_float, then pow
        y = torch.softmax(x @ w * scale, dim=-1)
        return (y * torch.arange(y.size(-1), dtype=y.dtype)).sum()

    cf = torch.compile(f, backend="kiln", dynamic=True)
    kiln.metrics.reset()
    # odd sizes, a transposed (non-contiguous) x, and no rows at all
    for rows, n, transposed in ((4, 3, False), (4, 7, True), (0, 12, False), (5, 12, True)):
        x = torch.randn(n, rows).t() if transposed else torch.randn(rows, n)
        x.requires_grad_()
        w = torch.randn(n, 5, requires_grad=True)
        want = f(x, w)
        gx, gw = torch.autograd.grad(want, (x, w))
        got = cf(x, w)
        cx, cw = torch.autograd.grad(got, (x, w))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cx, gx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-6)
    assert _fallbacks() == {}
    assert kiln.metrics.get("graphs_executed") >= 8


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * torch.sym_max(x.size(0), 3),
        lambda x: x * torch.sym_min(x.size(0), 3),
        lambda x: x * torch.sym_int(x.size(0) / 2),
        lambda x: x * torch.sym_float(x.size(0)),
        lambda x: x * math.sqrt(x.size(0)),
        lambda x: x * math.floor(x.size(0) / 3),
        lambda x: x * math.ceil(x.size(0) / 3),
    ],
    ids=["sym_max", "sym_min", "sym_int", "sym_float", "sqrt", "floor", "ceil"],
)
def test_sym_functions_of_sizes(fn) -> None:
    cf = torch.compile(fn, backend="kiln", dynamic=True)
    kiln.metrics.reset()
    for n in (2, 5, 9):
        for x in (torch.randn(n, 3), torch.randn(3, n).t()):  # contiguous and transposed
            assert torch.equal(cf(x), fn(x)), n
    assert _fallbacks() == {}


def test_convert_element_type_is_lowered() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        up = torch.ops.prims.convert_element_type.default(x, torch.float64)
        down = torch.ops.prims.convert_element_type.default(x * 3.5, torch.int32)
        return up * 2, down

    cf = torch.compile(f, backend="kiln")
    kiln.metrics.reset()
    x = torch.randn(5, 4) * 10
    got, want = cf(x), f(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert torch.equal(g, w)
    assert _fallbacks() == {}
