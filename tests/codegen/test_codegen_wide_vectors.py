"""Kernels with transcendental math are compiled for 512-bit vectors (kiln/codegen/cpp/emit.py,
``WIDE_VECTOR_OPS``): same values as eager, forward and gradients, over odd sizes, one-element
and empty dims and non-contiguous inputs; the attribute is on exactly the kernels that evaluate
such functions (memory-bound kernels keep the default width)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.cpp.emit import WIDE_VECTORS
from kiln.runtime.compiler import executables

MATH = ("kiln_erf", "kiln_gelu", "km::exp", "km::tanh", "km::log", "kiln_silu")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's NewGELU, written out as transformers does
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


FNS = {
    "gelu": lambda x, y: F.gelu(x) + y,
    "gelu_tanh": lambda x, y: _gelu_tanh(x) * y,
    "silu_exp": lambda x, y: F.silu(x) - torch.exp(y * 0.5),
    "sigmoid_log": lambda x, y: torch.sigmoid(x) + torch.log1p(y * y),
}


def _inputs(shape: tuple, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "transposed":  # same values read through strides
        x = torch.randn(shape[::-1]).t() if len(shape) == 2 else torch.randn(shape)
    else:
        x = torch.randn(shape)
    return x.requires_grad_(), torch.randn(shape).requires_grad_()


@pytest.mark.parametrize("name", sorted(FNS))
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((7, 13), "contiguous"),
        ((13, 7), "transposed"),
        ((1, 1), "contiguous"),
        ((0, 5), "contiguous"),
        ((3, 17, 33), "contiguous"),
    ],
)
def test_matches_eager_forward_and_gradients(name, shape, layout) -> None:
    torch.manual_seed(0)
    fn = FNS[name]
    x, y = _inputs(shape, layout)
    xe, ye = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(fn, backend="kiln")(x, y)
    want = fn(xe, ye)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    cot = torch.randn(shape)
    got.backward(cot)
    want.backward(cot)
    torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, ye.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.needs_backend("cpp", reason="checks the generated C++ source")
def test_attribute_only_on_kernels_with_transcendental_math() -> None:
    kiln.runtime.compiler.clear_memory_cache()
    torch._dynamo.reset()
    x, y = _inputs((9, 11), "contiguous")
    f = torch.compile(lambda x, y: F.gelu(x) * y, backend="kiln")
    f(x, y).sum().backward()
    g = torch.compile(lambda x, y: x * y + 1.0, backend="kiln")  # no transcendental math
    g(x.detach(), y.detach())
    kernels = [k for e in executables() for k in e.info.get("kernels", [])]
    checked = [k for k in kernels if k["kind"] in ("pointwise", "cols")]
    assert any(WIDE_VECTORS in k["source"] for k in checked)
    assert any(WIDE_VECTORS not in k["source"] for k in checked)
    for k in checked:
        assert (WIDE_VECTORS in k["source"]) == any(m in k["source"] for m in MATH), k["source"]
