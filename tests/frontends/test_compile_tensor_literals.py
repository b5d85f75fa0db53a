"""A tensor built from Python values inside a compiled frame (``torch.tensor([...])``) enters
AOTAutograd's graph as ``lift_fresh_copy`` of a constant; Kiln lowers it as the ``clone`` it is
(kiln/frontends/compile/fx.py), not as an opaque node run through Python and counted as a
fallback.  Values and gradients against eager, a literal nothing reads, a zero-size one."""

from __future__ import annotations

import torch

import kiln
from kiln import metrics


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="kiln")


def test_a_literal_used_in_the_step_matches_eager_and_is_no_fallback():
    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.tensor([1.5, -2.0, 0.25])  # built inside the frame on every call
        y = (x * w).sin().sum()
        (g,) = torch.autograd.grad(y, x)
        return y, g

    x = torch.randn(4, 3, requires_grad=True)
    want = step(x)
    with metrics.fallbacks_counted() as fell:
        got = _compiled(step)(x)
    assert fell == {}
    assert kiln.metrics.counters()["graphs_compiled"] >= 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)  # float32 ulps: Kiln's sin/cos are not ATen's


def test_literals_nothing_reads_and_empty_ones_are_no_fallback():
    # transformers' DynamicCache builds an empty key and value tensor per layer this way; the
    # training step then drops the cache
    def step(x: torch.Tensor) -> torch.Tensor:
        keys = torch.tensor([], dtype=x.dtype)
        cache = [torch.cat([keys.reshape(1, 0).expand(x.shape[0], 0), x], dim=1)]
        unused = torch.tensor([3.0, 4.0])  # noqa: F841
        return (x * 2).sum() + 0 * cache[0].sum()

    x = torch.randn(5, 2)
    with metrics.fallbacks_counted() as fell:
        got = _compiled(step)(x)
    assert fell == {}
    torch.testing.assert_close(got, step(x), rtol=0, atol=0)
