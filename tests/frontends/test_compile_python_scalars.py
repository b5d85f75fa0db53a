"""A Python float that changes between calls of a compiled function, where it reaches an op's
scalar argument (``p.add_(grad, alpha=-lr)`` in a hand-written update, ``clamp(max=s)``, a norm's
``eps``).

torch.compile passes such a float as a 0-dim tensor once it has changed; tracing bakes the value
of the compiling call into the graph with a guard the AOTAutograd cache does not keep, and the
graph's text is the same for every value.  With the cache on (Kiln's default, for warm start),
every later value failed the guard, recompiled, hit the first entry and computed with the old
number: a hand-written SGD step with a decaying learning rate kept the second step's rate, with no
error (torch 2.13; pytorch/pytorch#197889, Inductor too).  Kiln compiles such graphs without its
caches.  Here values and gradients against eager for each new value, and a training run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.config import config

_Y = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
PROGRAMS = {
    "add-alpha": lambda x, s: x.add(_Y, alpha=-s) * s,
    "clamp": lambda x, s: (x * s).clamp(max=s),
    "rms-norm-eps": lambda x, s: F.rms_norm(x * s, (4,), eps=s + 1e-3),
    "huber-delta": lambda x, s: F.huber_loss(x * s, _Y, delta=s),
    "sdpa-scale": lambda x, s: F.scaled_dot_product_attention(
        x[None] * s, x[None], x[None], scale=s
    ),
}


@pytest.fixture(autouse=True)
def _disk_cache_on(monkeypatch):
    monkeypatch.setattr(config, "disk_cache", True)  # the default, where the stale entry lived
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no-grad"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_each_value_of_a_python_float_is_used(name, grad):
    f = PROGRAMS[name]
    cf = kiln.compile(f)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    for s in (0.5, 0.7, 0.9, 1.3):
        xe, xc = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            want, got = f(xe, s), cf(xc, s)
        torch.testing.assert_close(got, want, msg=f"{name} at s={s}")
        if grad:
            want.sum().backward()
            got.sum().backward()
            torch.testing.assert_close(xc.grad, xe.grad, msg=f"{name} gradient at s={s}")


def _train(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def step(x: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 - lr * wd).add_(p.grad, alpha=-lr)
                p.grad = None
        return loss

    f = kiln.compile(step) if compiled else step
    g = torch.Generator().manual_seed(3)
    losses = [f(torch.randn(5, 8, generator=g), 0.1 / (i + 1), 0.01 * i).item() for i in range(5)]
    return losses, [p.detach().clone() for p in m.parameters()]


def test_hand_written_update_with_a_decaying_learning_rate_matches_eager():
    want, got = _train(compiled=False), _train(compiled=True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kiln.metrics.get("cache_skipped_python_scalars") > 0
