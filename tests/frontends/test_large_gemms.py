"""GEMMs large enough for oneDNN's inner product (kiln/passes/gemm_library.py), end to end: a
linear layer, a ``x @ W`` layer (GPT-2's Conv1D), 3-D inputs, transposed and sliced inputs, an
expanded bias, through ``backend="kiln"`` and the kiln device, against eager: the forward,
every gradient and the parameters after an AdamW step (the differential fuzzer's matmuls are
below the size at which the pass rewrites)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import metrics
from kiln.passes.gemm_library import available
from kiln.runtime.compiler import clear_memory_cache

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def compile_every_graph():
    """No graph served from a cache: each test's graphs go through the passes (and count)."""
    saved = kiln.config.disk_cache
    kiln.config.update(disk_cache=False)
    clear_memory_cache()
    torch._dynamo.reset()  # no frame compiled by an earlier test reused
    yield
    kiln.config.update(disk_cache=saved)
    clear_memory_cache()


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Within a few ulp of the largest element per sqrt(reduction length): oneDNN and MKL sum
    the products in different orders."""
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * scale * max(k, 1) ** 0.5)


class Net(torch.nn.Module):
    """Linear (weight read as ``t(w)``), then a Conv1D-style ``x @ W + b``, GELU between."""

    def __init__(self, d_in: int = 256, hidden: int = 512, d_out: int = 384) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d_in, hidden)
        self.w2 = torch.nn.Parameter(torch.randn(hidden, d_out) * hidden**-0.5)
        self.b2 = torch.nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x)) @ self.w2 + self.b2


def _inputs(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "2d":
        return torch.randn(512, 256, generator=g)
    if kind == "3d":
        return torch.randn(4, 128, 256, generator=g)
    if kind == "transposed":  # column-major rows: the left operand is a transposed view
        return torch.randn(256, 512, generator=g).t()
    return torch.randn(512, 512, generator=g)[:, 128:384]  # sliced: row stride 512


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    loss = (out * out).mean()
    loss.backward()
    opt.step()  # the gradients are kept (compared below)
    return out


def _mode_step(model: torch.nn.Module, mode: str, x: torch.Tensor) -> tuple:
    """One AdamW step of ``model`` on ``x`` in ``mode`` ("compile" or "lazy"): the output, the
    input's gradient, the parameters' gradients and the parameters after the step, on the CPU."""
    if mode == "lazy":
        dev = kiln.device()
        model = model.to(dev)
        xi = x.to(dev).requires_grad_(True)
        got = _step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), xi)
        kiln.mark_step()
        return (
            got.cpu(),
            xi.grad.cpu(),
            [p.grad.cpu() for p in model.parameters()],
            [p.detach().cpu() for p in model.parameters()],
        )
    xi = x.clone().requires_grad_(True)
    before = metrics.get("graphs_compiled")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = torch.compile(_step, backend="kiln")(model, opt, xi)
    assert metrics.get("graphs_compiled") > before
    return (
        got,
        xi.grad,
        [p.grad for p in model.parameters()],
        [p.detach() for p in model.parameters()],
    )


def _check_update(init: torch.nn.Module, grads: list, params: list) -> None:
    """AdamW's first step is lr * g / (|g| + eps): a gradient a few ulp off moves an element whose
    gradient is ~eps by a good part of a step, so the parameters are checked against eager's
    AdamW applied to the mode's own gradients (a wrong gradient scale or a missed update shows;
    the gradients themselves are compared with eager's by the caller)."""
    init_opt = torch.optim.AdamW(init.parameters(), lr=1e-2)
    for p, g in zip(init.parameters(), grads):
        p.grad = g.clone()
    init_opt.step()
    for p, pr in zip(params, init.parameters()):
        torch.testing.assert_close(p, pr.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["2d", "3d", "transposed", "sliced"])
@pytest.mark.parametrize("mode", ["compile", "lazy"])
def test_training_step_matches_eager(kind, mode):
    torch.manual_seed(0)
    ref = Net()
    mine = copy.deepcopy(ref)
    init = copy.deepcopy(ref)
    x = _inputs(kind)
    x_ref = x.clone().requires_grad_(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = _step(ref, ref_opt, x_ref)
    grads_ref = [p.grad.clone() for p in ref.parameters()]

    onednn = metrics.get("gemm_onednn")
    got, x_grad, grads, params = _mode_step(mine, mode, x)

    # at least three of the six GEMMs ran on oneDNN: the second layer's forward (its left operand
    # is the GELU kernel's output) and the backward's two input gradients. The first layer's
    # forward reads the graph input x, whose layout the graph does not know, and so does the
    # second layer's weight gradient in compile mode (AOTAutograd saves h^T, a transposed view):
    # MKL; the first layer's weight gradient would need a transposing copy of dY where the
    # backward holds the most (test_weight_gradient_copies_match_eager has copies)
    assert metrics.get("gemm_onednn") >= onednn + 3
    _close(got, want, 512)
    _close(x_grad, x_ref.grad, 512)
    assert all(g.abs().max() > 0 for g in grads_ref)
    for g, gr in zip(grads, grads_ref):
        _close(g, gr, 512)
    _check_update(init, grads, params)


def test_expanded_bias_argument():
    """The bias is a compiled function's argument, expanded (stride 0): oneDNN would read it as
    dense, so the backend reads it through ``contiguous``."""
    torch.manual_seed(0)
    x, w = torch.randn(512, 256), torch.randn(384, 256)

    def f(x, w, b):
        return F.linear(x, w, b)

    compiled = torch.compile(f, backend="kiln")
    for b in (torch.randn(384), torch.randn(1).expand(384), torch.randn(768)[::2]):
        _close(compiled(x, w, b), f(x, w, b), 256)


class Deep(torch.nn.Module):
    """Four linear layers, ReLU between: the backward's later weight gradients come after the
    first layers' activations are freed, where a transposing copy of dY fits under the peak."""

    def __init__(self) -> None:
        super().__init__()
        dims = [256, 512, 512, 512, 384]
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.relu(x))
        return x


@pytest.mark.parametrize("mode", ["compile", "lazy"])
def test_weight_gradient_copies_match_eager(mode):
    """Weight gradients on oneDNN after Kiln's transposing copy of dY (counted), against eager:
    output, input and parameter gradients, and AdamW's update of those gradients."""
    torch.manual_seed(0)
    ref = Deep()
    mine, init = copy.deepcopy(ref), copy.deepcopy(ref)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_(True)
    want = _step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), x_ref)
    copies = metrics.get("gemm_transposing_copies")
    got, x_grad, grads, params = _mode_step(mine, mode, x)
    assert metrics.get("gemm_transposing_copies") > copies
    _close(got, want, 512)
    _close(x_grad, x_ref.grad, 512)
    for g, p in zip(grads, ref.parameters()):
        _close(g, p.grad, 512)
    _check_update(init, grads, params)
