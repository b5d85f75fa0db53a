"""Scaled dot-product attention through ``torch.compile(backend="kiln")``: forward and gradients.

The regression: torch's decomposition of ``_scaled_dot_product_flash_attention_for_cpu`` returns the
attention probabilities where the kernel returns the log-sum-exp, and the backward kernel read them as
the log-sum-exp (gradients off by ~1e2 while the forward matched).  Every argument variant that
``transformers`` and users pass is checked against eager, with a random cotangent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln

S = (2, 4, 16, 8)


@pytest.fixture(autouse=True)
def _sdpa_kernels(monkeypatch):
    """These sizes have short keys, which the backend rewrites to the attention chain
    (``short_attention``, tested in tests/frontends/test_compile_short_attention.py); here the
    calls stay SDPA, so that ATen's flash kernels and Kiln's handling of them are what is
    checked."""
    monkeypatch.setattr(kiln.config, "disable_passes", "short_attention")
    torch._dynamo.reset()


def _grads(fn, xs, cot):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs, cot)


def _heads_last(shape):
    """A (B, H, L, E) tensor laid out as (B, L, H, E) and transposed, as transformers passes it."""
    b, h, l, e = shape
    return torch.randn(b, l, h, e).transpose(1, 2)


CASES = {
    "causal": (dict(is_causal=True), [S, S, S]),
    "no_mask": ({}, [S, S, S]),
    "bool_mask": (dict(attn_mask=torch.rand(16, 16) > 0.3), [S, S, S]),
    "float_mask": (dict(attn_mask=torch.randn(2, 1, 16, 16)), [S, S, S]),
    "scale_causal": (dict(scale=0.3, is_causal=True), [S, S, S]),
    "gqa": (dict(enable_gqa=True), [S, (2, 2, 16, 8), (2, 2, 16, 8)]),
    "l_ne_s_causal": (dict(is_causal=True), [(2, 4, 5, 8), S, S]),
    "value_dim_differs": ({}, [S, S, (2, 4, 16, 5)]),
    "empty_batch": ({}, [(0, 4, 16, 8)] * 3),
    "single_token": (dict(is_causal=True), [(2, 4, 1, 8)] * 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_matches_eager(name):
    torch.manual_seed(0)
    kw, shapes = CASES[name]
    xs = [torch.randn(s) for s in shapes]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    cot = torch.randn(fn(*xs).shape)
    torch._dynamo.reset()
    eo, eg = _grads(fn, xs, cot)
    ko, kg = _grads(torch.compile(fn, backend="kiln"), xs, cot)
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sdpa_non_contiguous_qkv_and_learned_mask():
    torch.manual_seed(0)
    xs = [_heads_last(S) for _ in range(3)] + [torch.randn(2, 1, 16, 16)]

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    cot = torch.randn(S)
    torch._dynamo.reset()
    ko, kg = _grads(torch.compile(fn, backend="kiln"), xs, cot)
    eo, eg = _grads(fn, xs, cot)
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_sdpa_input_whose_last_stride_differs_from_eager(launcher):
    """q is a view of a Kiln kernel's output: eager keeps the permuted layout of the kernel's input
    (``x.transpose * 2`` is laid out as x, so transposing back is contiguous), Kiln's kernel writes
    it contiguous, so the view reaches the flash kernel with a last stride of 8.  ATen's CPU flash
    kernels read the last dim as unit-strided: the forward was off by ~3.5, silently."""
    torch.manual_seed(0)
    xs = [torch.randn(S) for _ in range(3)]

    def fn(x, k, v):
        q = (x.transpose(-1, -2) * 2).transpose(-1, -2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cot = torch.randn(S)
    torch._dynamo.reset()
    eo, eg = _grads(fn, xs, cot)
    kiln.config.update(launcher=launcher == "native")
    kiln.metrics.reset()
    try:
        ko, kg = _grads(torch.compile(fn, backend="kiln"), xs, cot)
    finally:
        kiln.config.update(launcher=True)
    assert kiln.metrics.get("sdpa_to_chain") == 0  # ATen's flash kernels ran
    if launcher == "native":  # ... called by the launcher itself, which copied the view
        assert kiln.metrics.get("launcher_graphs") >= 2
        assert kiln.metrics.get("launcher_python_nodes") == 0
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
