"""prims::fma, which Dynamo writes for in-place ``addcmul_`` / ``addcdiv_`` with a ``value`` (every
single-tensor Adam/AdamW step), is a Kiln op: computed by Kiln, not counted as a fallback, and
run with the Python number Dynamo passes as its ``b`` operand, in every dtype."""

from __future__ import annotations

import pytest
import torch

from kiln import metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["addcmul_", "addcdiv_"])
def test_inplace_addc_with_value(dtype, method):
    def f(x, t1, t2):
        y = x * 1.5
        getattr(y, method)(t1, t2, value=-0.25)
        return y

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(5, 7, generator=g, dtype=dtype) for _ in range(3)]
    args[2] = args[2].abs() + 0.5
    torch._dynamo.reset()
    metrics.reset()
    got = torch.compile(f, backend="kiln")(*args)
    torch.testing.assert_close(
        got, f(*args), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12
    )
    assert metrics.counters()["fallbacks"] == {}
    assert metrics.counters()["graphs_compiled"] >= 1


def test_adamw_step_has_no_fallback():
    """float64 AdamW, the whole step compiled: Kiln against eager to float64 rounding.  (Dynamo's
    own trace of the optimizer's loop computes the bias corrections from the float32 ``step``
    tensor, ~2e-7 off eager here with any backend, ATen's included; Kiln traces the loop as
    its list form in its frames, with eager's float64 bias corrections: optimizer_forms.py.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    ref = torch.nn.Linear(6, 3).double()
    ref.load_state_dict(model.state_dict())

    def make(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        return step

    eager = make(ref)
    compiled = torch.compile(make(model), backend="kiln")
    torch._dynamo.reset()
    metrics.reset()
    for _ in range(3):
        x = torch.randn(4, 6, dtype=torch.float64)
        eager(x)
        compiled(x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    assert metrics.counters()["fallbacks"] == {}
    assert metrics.counters()["graphs_compiled"] >= 1


@pytest.mark.parametrize("case", ["contiguous", "transposed_broadcast", "zero_rows"])
def test_addcmul_value_forward_and_gradients(case):
    """Forward and gradients against eager: a transposed ``t1`` and a broadcast row ``t2`` read
    through their strides, and zero rows."""
    g = torch.Generator().manual_seed(1)
    rows = 0 if case == "zero_rows" else 6
    x = torch.randn(rows, 7, generator=g)
    t1 = (
        torch.randn(7, rows, generator=g).t()
        if case == "transposed_broadcast"
        else torch.randn(rows, 7, generator=g)
    )
    t2 = (
        torch.randn(7, generator=g)
        if case == "transposed_broadcast"
        else torch.randn(rows, 7, generator=g)
    )

    def f(x, t1, t2):
        y = x * 1.5
        y.addcmul_(t1, t2, value=-0.25)
        return (y * y).sum()

    def run(fn):
        leaves = [a.detach().clone().requires_grad_() for a in (x, t1, t2)]
        out = fn(*leaves)
        out.backward()
        return out.detach(), [a.grad for a in leaves]

    torch._dynamo.reset()
    metrics.reset()
    got, got_grads = run(torch.compile(f, backend="kiln"))
    want, want_grads = run(f)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert "fma" not in metrics.counters()["fallbacks"]
