"""bf16 through Kiln's compiled paths: autocast matches eager, stochastic rounding is fused into
the generated kernels (compile mode and lazy device), reproducible, and does not stall."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln import metrics
from kiln.precision import manual_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench/
from bench.precision_study import mlp


@pytest.fixture
def sr_on():
    old = kiln.config.stochastic_rounding
    kiln.config.update(stochastic_rounding=True)
    yield
    kiln.config.update(stochastic_rounding=old)


def _autocast_step(m):
    def f(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        return loss

    return f


def test_autocast_grads_match_eager():
    torch.manual_seed(0)
    x, y = torch.randn(256, 64), torch.randn(256, 64)
    m_e, m_k, m_64 = mlp(0), mlp(0), mlp(0).double()
    le = _autocast_step(m_e)(x, y)
    torch._dynamo.reset()
    lk = torch.compile(_autocast_step(m_k), backend="kiln")(x, y)
    torch.nn.functional.mse_loss(m_64(x.double()), y.double()).backward()
    assert torch.allclose(lk, le, rtol=1e-5, atol=0)
    for pe, pk, p64 in zip(m_e.parameters(), m_k.parameters(), m_64.parameters()):
        assert pk.grad.dtype == torch.float32
        # bf16 matmuls accumulate in fp32 as in eager; fp32 sums may be reassociated (threads),
        # which can flip a bf16 rounding: compare at bf16 precision, and against float64
        ref = p64.grad.float()
        assert (pk.grad - pe.grad).norm() <= 2**-8 * ref.norm()
        assert (pk.grad - ref).norm() <= 1.1 * (pe.grad - ref).norm() + 1e-6 * ref.norm()


def test_pure_bf16_step_matches_eager():
    torch.manual_seed(0)
    x, y = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    ms = [mlp(0).bfloat16() for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in ms]

    def step_of(m, opt):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    torch._dynamo.reset()
    fused0 = metrics.get("fused_kernels")
    lk = torch.compile(step_of(ms[0], opts[0]), backend="kiln")(x, y)
    le = step_of(ms[1], opts[1])(x, y)
    if kiln.config.backend == "cpp":  # bf16 pointwise ops became generated kernels
        assert metrics.get("fused_kernels") > fused0
    assert lk.dtype == torch.bfloat16 and torch.equal(lk, le)
    for pk, pe in zip(ms[0].parameters(), ms[1].parameters()):
        assert pk.dtype == torch.bfloat16
        # each op rounds its result to bf16 as eager does; fused formulas may differ from ATen's
        # by one bf16 step of an intermediate (update-sized, ~lr): within 1/32 of lr, or 1 step
        assert torch.allclose(pk.float(), pe.float(), rtol=2**-7, atol=1e-3 / 32)


def _add_chain(w: torch.Tensor) -> torch.Tensor:
    return (w.float() + 1e-3).to(torch.bfloat16)


def test_compiled_sr_does_not_stall(sr_on):
    torch._dynamo.reset()
    f = torch.compile(_add_chain, backend="kiln")
    manual_seed(0)
    w = torch.ones(10_000, dtype=torch.bfloat16)
    for _ in range(1000):
        w = f(w)
    assert abs(w.double().mean().item() - 2.0) <= 0.01
    kiln.config.update(stochastic_rounding=False)
    torch._dynamo.reset()
    f = torch.compile(_add_chain, backend="kiln")
    w = torch.ones(10_000, dtype=torch.bfloat16)
    for _ in range(1000):
        w = f(w)
    assert bool((w == 1.0).all())


def test_compiled_sr_reproducible(sr_on):
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: (a * b).to(torch.bfloat16), backend="kiln")
    a, b = torch.randn(5000), torch.randn(5000)
    manual_seed(11)
    r1 = [f(a, b).view(torch.int16) for _ in range(2)]
    manual_seed(11)
    r2 = [f(a, b).view(torch.int16) for _ in range(2)]
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    assert not torch.equal(r1[0], r1[1])  # the step advanced: new random bits, same kernel
    exact = (a * b).to(torch.bfloat16)
    assert 0 < int((r1[0] != exact.view(torch.int16)).sum()) < 5000
    nan = torch.tensor([float("nan"), float("inf"), -0.0])
    out = f(nan, torch.ones(3))
    assert out[0].isnan() and out[1] == float("inf") and str(out[2].item()) == "-0.0"


def test_lazy_sr_does_not_stall(sr_on):
    dev = kiln.device()
    manual_seed(0)
    w = torch.ones(10_000, dtype=torch.bfloat16).to(dev)
    for _ in range(1000):
        w = _add_chain(w)
        kiln.mark_step()
    assert abs(w.cpu().double().mean().item() - 2.0) <= 0.01


def test_lazy_foreach_update_is_stochastic(sr_on):
    """The lazy device's foreach optimizer ops (recorded per tensor and fused into generated
    kernels) round their bf16 results stochastically: 100 updates of +1e-3 move 1.0 to ~1.1,
    where round-to-nearest keeps it at 1.0 (bf16's spacing at 1 is 2**-7)."""
    dev = kiln.device()
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16).to(dev))
    opt = torch.optim.SGD([p], lr=1e-3)
    before = dict(metrics.counters()["fallbacks"])
    for _ in range(100):
        p.grad = torch.full((4096,), -1.0, dtype=torch.bfloat16).to(dev)
        opt.step()
        kiln.mark_step()
    after = metrics.counters()["fallbacks"]
    assert not [k for k in after if k.startswith("_foreach") and after[k] > before.get(k, 0)]
    assert abs(p.detach().cpu().double().mean().item() - 1.1) < 0.01  # round to nearest: 1.0
