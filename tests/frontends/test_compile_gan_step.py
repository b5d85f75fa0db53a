"""A GAN training step compiled whole (PyTorch's DCGAN recipe): the discriminator's loss on
``fake.detach()`` is backpropagated first, then the generator's loss through ``fake``.

AOTAutograd made the generator's output and the discriminator's loss one autograd node; the first
``backward()`` ran and freed it, and the second raised "Trying to backward through the graph a
second time" (Inductor and aot_eager too).  Kiln leaves a graph whose outputs belong to separate
autograd graphs to eager autograd (``kiln/frontends/compile/autograd_parts.py``), counted as a
fallback.  Here the losses and both networks' parameters against eager, and the counting rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.frontends.compile.autograd_parts import detached_across_parts, separate_autograd_parts


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return g, d


def _train(compiled: bool) -> list[torch.Tensor]:
    g, d = _nets()
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=1e-3, betas=(0.5, 0.999))

    def step(z: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(z.shape[0], 1)
        fake = g(z)
        loss_d = F.binary_cross_entropy_with_logits(
            d(real), ones
        ) + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = F.binary_cross_entropy_with_logits(d(fake), ones)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        return loss_d.detach(), loss_g.detach()

    f = kiln.compile(step) if compiled else step
    gen = torch.Generator().manual_seed(1)
    losses = [
        torch.stack(f(torch.randn(6, 4, generator=gen), torch.randn(6, 8, generator=gen)))
        for _ in range(4)
    ]
    return [torch.stack(losses), *(p.detach() for p in (*g.parameters(), *d.parameters()))]


def test_gan_step_compiled_whole_trains_as_eager():
    torch._dynamo.reset()
    before = kiln.metrics.counters()["fallbacks"].get("graph:separate autograd graphs", 0)
    got = _train(compiled=True)
    for a, b in zip(got, _train(compiled=False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kiln.metrics.counters()["fallbacks"]["graph:separate autograd graphs"] > before


def _captured(fn, *args) -> torch.fx.GraphModule:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


@pytest.mark.parametrize(
    ("body", "parts", "detached"),
    [
        (lambda a, b, x: (a(x), b(a(x).detach())), 2, True),  # the GAN shape
        (lambda a, b, x: (a(x), b(a(x))), 1, False),  # one graph through both
        (lambda a, b, x: (a(x) + b(x),), 1, False),
        (lambda a, b, x: (a(x).detach(), b(x)), 1, False),  # one output needs no grad
        # two encoders whose loss is taken after the graph: two parts, no cut between them (one
        # backward() runs both; left compiled as one)
        (lambda a, b, x: (a(x), b(x)), 2, False),
        (lambda a, b, x: (a(x), b(a(x).argmax(1, keepdim=True).float() * x)), 2, True),
    ],
)
def test_parts_are_counted_as_autograd_sees_them(body, parts, detached):
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    gm = _captured(lambda x: body(a, b, x), torch.randn(2, 3))
    assert separate_autograd_parts(gm) == parts
    assert detached_across_parts(gm) is detached
