"""``torch.compile(backend="kiln")`` on tensors that are not on the CPU.

Kiln generates CPU code.  A graph holding a tensor on another device (cuda, meta) used to reach the
C++ kernels, which read device memory as host memory: the process died (SIGSEGV on meta tensors).
Now such a graph runs as Dynamo captured it (ATen on that device), counted as a graph fallback that
names the device; CPU graphs in the same process still go through Kiln.
"""

from __future__ import annotations

import pytest
import torch

import kiln  # noqa: F401 - registers the backend
from kiln import metrics


def _graph_fallbacks() -> dict[str, int]:
    return {k: v for k, v in metrics.counters()["fallbacks"].items() if k.startswith("graph:")}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x).tanh(), y)
    loss.backward()
    opt.step()
    return loss


def _train(device: str, compiled: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = torch.compile(_step, backend="kiln") if compiled else _step
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        losses.append(float(step(model, opt, x.to(device), y.to(device))))
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_meta_tensors_run_as_captured_instead_of_crashing():
    torch._dynamo.reset()
    metrics.reset()

    def f(x, w):
        return (x @ w * 2).sin().sum(-1)

    x = torch.randn(4, 8, device="meta")
    w = torch.randn(8, 3, device="meta", requires_grad=True)
    out = torch.compile(f, backend="kiln")(x, w)
    out.sum().backward()
    assert out.device.type == "meta" and out.shape == (4,)
    assert w.grad is not None and w.grad.shape == (8, 3) and w.grad.device.type == "meta"
    reasons = _graph_fallbacks()
    assert reasons and all("on meta" in r and "CPU tensors only" in r for r in reasons), reasons


def test_cpu_graphs_still_compile_next_to_foreign_ones():
    torch._dynamo.reset()
    metrics.reset()
    eager_losses, eager_params = _train("cpu", compiled=False)
    losses, params = _train("cpu", compiled=True)
    assert not _graph_fallbacks()
    assert metrics.counters().get("graphs_executed", 0) > 0  # the steps ran through Kiln
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_step_runs_as_captured_and_matches_eager():
    torch._dynamo.reset()
    metrics.reset()
    eager_losses, eager_params = _train("cuda", compiled=False)
    losses, params = _train("cuda", compiled=True)
    reasons = _graph_fallbacks()
    assert reasons and all("on cuda" in r for r in reasons), reasons
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
