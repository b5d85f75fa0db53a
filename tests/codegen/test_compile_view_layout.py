"""A view the traced graph takes of a value whose layout Kiln chose differently from eager.

Eager keeps a permuted input's layout through pointwise ops, so AOTAutograd traces
``y.transpose(1, 2).reshape(...)`` as a plain ``view``; Kiln's fused kernel writes ``y``
contiguous, where that view is impossible.  Rotary-embedding models (Llama, Gemma, Qwen2) hit this
in compile mode.  The graph is functional, so the executor reshapes (copies) instead.
"""

from __future__ import annotations

import torch

import kiln  # noqa: F401  (registers the backend)


def step(x: torch.Tensor) -> torch.Tensor:
    y = x.transpose(1, 2) * 2.0 + 1.0  # eager: y keeps x's transposed layout
    b, h, l = y.shape
    return y.transpose(1, 2).reshape(b, l * h).sin()


def test_view_of_a_value_laid_out_differently_from_eager() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, requires_grad=True)
    want = step(x)
    (gx,) = torch.autograd.grad(want.sum(), x)

    xc = x.detach().clone().requires_grad_(True)
    got = torch.compile(step, backend="kiln")(xc)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xc.grad, gx, rtol=1e-6, atol=1e-6)
