"""``backward(retain_graph=True)`` through a compiled training step: two losses that share a trunk,
backpropagated one after the other (auxiliary losses, multi-task heads).

Kiln compiles the backward with the forward (one AOTAutograd cache entry holds both); AOTAutograd
then held a list of saved tensors the backward may overwrite and refused ``retain_graph=True``
("compiled with non-empty donated buffers").  Inductor, which compiles the backward at its first
run, trained.  Kiln's backward donates no buffers and says so.  Here losses, gradients and
parameters against eager, compiled afresh and loaded from the cache."""

from __future__ import annotations

import torch
from torch import nn

import kiln


def _train(compiled: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    trunk, head = nn.Linear(4, 8), nn.Linear(8, 2)
    params = [*trunk.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    grads: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        t = trunk(x).relu()
        main, aux = head(t).pow(2).mean(), t.mean()
        opt.zero_grad()
        main.backward(retain_graph=True)
        aux.backward()
        grads.extend(p.grad.detach().clone() for p in params)
        opt.step()
        return main.detach() + aux.detach()

    f = kiln.compile(step) if compiled else step
    gen = torch.Generator().manual_seed(1)
    losses = torch.stack([f(torch.randn(3, 4, generator=gen)) for _ in range(3)])
    return [losses, *grads, *(p.detach() for p in params)]


def test_retained_graph_backward_twice_matches_eager():
    want = _train(compiled=False)
    for attempt in ("compiled", "from the cache"):
        torch._dynamo.reset()
        hits = kiln.metrics.get("aot_cache_hits")
        got = _train(compiled=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=attempt)
    if kiln.config.disk_cache:
        assert kiln.metrics.get("aot_cache_hits") > hits  # the second round loaded its entry
