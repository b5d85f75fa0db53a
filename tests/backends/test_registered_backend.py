"""A backend is looked up in the registry, with no special case in the compile path: a training step
(forward, gradients, AdamW update) runs on both frontends through the reference interpreter, and
through a backend registered by the test itself, and matches eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.codegen import Backend, register_backend
from kiln.codegen.base import unregister_backend
from kiln.codegen.interpreter import build as interpreter_build
from kiln.config import config
from kiln.runtime.compiler import executables

STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.down(F.gelu(self.norm(self.up(x)))), y)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g))] * STEPS


def _train(model: nn.Module, step, dev: str | torch.device, sync=lambda: None) -> list:
    """Per step: (loss, gradients, parameters after the AdamW update), on the CPU."""
    model = copy.deepcopy(model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for x, y in _batches():
        loss = step(model, opt, x.to(dev), y.to(dev))
        sync()
        grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        params = [p.detach().cpu().clone() for p in model.parameters()]
        out.append((loss.detach().cpu(), grads, params))
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss


@pytest.fixture
def counting_backend():
    """A backend of one function: the interpreter's build, counting what it built."""
    built: list[int] = []

    def build(g):
        built.append(len(g))
        run, info = interpreter_build(g)
        return run, {**info, "backend": "counting"}

    register_backend(Backend("counting", build))
    yield built
    unregister_backend("counting")


# both frontends reach the backend through the same compile path: one of them suffices for the
# test's own backend
@pytest.mark.parametrize(
    ("frontend", "backend"),
    [("compile", "interpreter"), ("lazy", "interpreter"), ("lazy", "counting")],
)
def test_training_step_through_a_registered_backend(frontend, backend, request):
    built = request.getfixturevalue("counting_backend") if backend == "counting" else None
    torch.manual_seed(0)
    model = Block()
    expected = _train(model, _step, "cpu")
    saved = config.backend
    config.update(backend=backend)
    try:
        torch._dynamo.reset()
        before = {id(e): e.runs for e in executables()}
        if frontend == "compile":
            got = _train(model, torch.compile(_step, backend="kiln"), "cpu")
        else:
            got = _train(model, _step, kiln.device(), kiln.mark_step)
        ran = [e for e in executables() if e.runs > before.get(id(e), 0)]
    finally:
        config.update(backend=saved)
    assert ran and {e.info["backend"] for e in ran} == {backend}
    assert not any(n.op == "fused" for e in ran for n in e.graph.nodes)  # no C++ passes ran
    if built is not None:
        assert built, "the registered backend built nothing"
    for (le, ge, pe), (lk, gk, pk) in zip(expected, got, strict=True):
        torch.testing.assert_close(lk, le, rtol=1e-5, atol=1e-6)
        for a, b in zip(gk + pk, ge + pe, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
