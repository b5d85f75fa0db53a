"""The kernels of a lazy training step (issue 10: the lazy step's graph against compile mode's).

The lazy device records forward and backward ops as autograd runs them, so its graph holds forms
compile mode never sees (compile mode's backward is AOTAutograd's decomposition): ATen's C++
composites (``1 - sigmoid`` in SiLU's backward as ``empty_like`` + ``fill`` + ``sub``), whole
``nll_loss_backward`` + ``_log_softmax_backward_data``.  Each test trains a small model for a few
AdamW steps on the kiln device with both recorders (the Python recorder and the native one) and
compares the loss, every gradient and every updated parameter with eager, then checks the
optimized graph of the last step for the kernel the pass makes (kernels only under the C++
backend, whose passes make them; values under every backend).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import device_recorder
from torch import nn

import kiln
from kiln.frontends.lazy import native
from kiln.frontends.lazy import trace as T
from kiln.ir.graph import Graph
from kiln.runtime.compiler import compile_graph

dev = kiln.device()
CPP = kiln.config.backend == "cpp"  # the kernels checked here are the C++ backend's


@pytest.fixture(params=["python", "native"])
def recorder(request: pytest.FixtureRequest) -> Iterator[str]:
    with device_recorder(request.param):
        yield request.param


def _last_graph(p: torch.Tensor) -> Graph:
    """The optimized graph of the last lazy step (either recorder)."""
    raw = native.last_graph() if native.is_native(p) else T._last_entry.graph
    assert raw is not None
    return compile_graph(raw).graph


def train_against_eager(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor],
    batches: list[tuple],
    atol: float = 2e-5,
) -> Graph:
    """AdamW steps on the kiln device and in eager: losses, gradients and parameters compared at
    every step; the optimized graph of the last lazy step."""
    ref = copy.deepcopy(model)
    lazy = copy.deepcopy(model).to(dev)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt_lazy = torch.optim.AdamW(lazy.parameters(), lr=1e-2, weight_decay=0.01)
    graph = None
    for batch in batches:
        want = loss_fn(ref, batch)
        want.backward()
        got = loss_fn(lazy, tuple(t.to(dev) for t in batch))
        got.backward()
        opt_lazy.step()  # AdamW leaves the gradients as they are
        opt_ref.step()
        kiln.mark_step()  # the whole step: one graph
        graph = _last_graph(next(lazy.parameters()))
        grads = [p.grad.cpu() for p in lazy.parameters()]
        torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=1e-5, equal_nan=True)
        for (name, p), g in zip(ref.named_parameters(), grads):
            torch.testing.assert_close(g, p.grad, atol=atol, rtol=1e-5, equal_nan=True, msg=name)
        for (name, p), q in zip(ref.named_parameters(), lazy.parameters()):
            torch.testing.assert_close(
                q.detach().cpu(), p.detach(), atol=atol, rtol=1e-5, equal_nan=True, msg=name
            )
        opt_lazy.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        kiln.mark_step()
    assert graph is not None
    return graph


def fused_bodies(g: Graph) -> list[list[str]]:
    return [[entry[0] for entry in n.kwarg("body")] for n in g.nodes if n.op == "fused"]


class GatedMLP(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 7), (0, 5, 7), (4, 7)])
def test_silu_backward_is_one_kernel_without_a_tensor_of_ones(recorder, shape) -> None:
    torch.manual_seed(0)
    d, h = shape[-1], 13
    model = GatedMLP(d, h)
    batches = [(torch.randn(shape), torch.randn(shape)) for _ in range(3)]
    g = train_against_eager(model, _mse, batches)
    ops = {n.op for n in g.nodes}
    assert not {"fill.Scalar", "empty_like.default"} & ops, sorted(ops)
    # the op whole (not PyTorch's decomposition: sigmoid, fill, sub, mul, add, mul), fused
    bodies = fused_bodies(g) if CPP else []
    assert not any("sigmoid.default" in b for b in bodies), bodies
    assert not CPP or any("silu_backward.default" in b for b in bodies), g


def test_silu_backward_on_non_contiguous_input(recorder) -> None:
    torch.manual_seed(1)
    model = GatedMLP(6, 9)
    batches = [(torch.randn(6, 4, 3).transpose(0, 2), torch.randn(3, 4, 6)) for _ in range(2)]
    g = train_against_eager(model, _mse, batches)
    assert "fill.Scalar" not in {n.op for n in g.nodes}


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(max(vocab, 1), d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


def _ce(reduction: str, ignore: int) -> Callable[[nn.Module, tuple], torch.Tensor]:
    def loss(model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        out = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            y.reshape(-1),
            ignore_index=ignore,
            reduction=reduction,
        )
        return out.sum() * 0.5 if reduction == "none" else out

    return loss


def _lm_batches(rows: tuple, vocab: int, ignore: int, ignored: float, n: int = 3) -> list:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, rows, generator=gen)
        y = torch.randint(0, vocab, rows, generator=gen)
        y[torch.rand(rows, generator=gen) < ignored] = ignore
        out.append((x, y))
    return out


@pytest.mark.parametrize(
    "rows,vocab,reduction,ignore,ignored",
    [
        ((3, 7), 11, "mean", -100, 0.3),
        ((2, 5), 13, "sum", -100, 0.0),
        ((4, 3), 9, "none", -100, 0.5),
        ((3, 5), 6, "mean", 2, 0.4),  # ignore_index a real class
        ((1, 1), 5, "mean", -100, 0.0),
        ((3, 4), 1, "mean", -100, 0.2),
        ((2, 3), 7, "mean", -100, 1.0),  # every target ignored: NaN loss, zero gradients
    ],
)
def test_cross_entropy_backward_is_one_row_kernel(
    recorder, rows, vocab, reduction, ignore, ignored
):
    torch.manual_seed(0)
    model = TinyLM(vocab, 6)
    g = train_against_eager(
        model, _ce(reduction, ignore), _lm_batches(rows, vocab, ignore, ignored)
    )
    ops = [n.op for n in g.nodes]
    if CPP:
        assert "nll_loss_backward.default" not in ops, ops
        assert ops.count("nll_log_softmax_backward.default") == 1, ops


def test_cross_entropy_backward_on_non_contiguous_logits(recorder):
    torch.manual_seed(0)

    class Transposed(TinyLM):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.t()).transpose(0, 1)  # [B, T, V] read as [T, B, V]

    model = Transposed(10, 5)
    batches = [(x.t().contiguous(), y) for x, y in _lm_batches((4, 3), 10, -100, 0.25)]
    g = train_against_eager(model, _ce("mean", -100), batches)
    assert not CPP or "nll_log_softmax_backward.default" in {n.op for n in g.nodes}
