"""A training step's ops recorded in C++ by the native recorder (``table.py``'s ``TRAINING``):
softmax / log-softmax and their backward ops, GELU's backward, the NLL loss forward (two outputs)
and backward, embedding and its dense backward, masked_fill, bitwise_not, and the layer norm
forward and backward (three outputs: one getitem node each).  On the kiln device with the
native recorder as its recorder (``config.lazy_recorder = "native"``): forward and gradients
against eager on odd, size-0 and non-contiguous inputs, with no Python fallback call for these
ops; the converted graph equal to the Python recorder's; a steady training step (loss, gradients,
updated parameters against eager) with none of these ops in the Python fallback."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import (  # noqa: F401 - native_device: the module fixture
    SHAPES,
    check_same_graph_as_the_python_recorder,
    native_device,
    on_device_and_eager,
    python_calls_since,
)

import kiln
from kiln.frontends.lazy import native
from kiln.frontends.lazy.native import table

dev = kiln.device()
CPP_OPS = {f"aten::{op}" for op in table.TRAINING}


pytestmark = pytest.mark.usefixtures("native_device")


def _labels(x: torch.Tensor, classes: int) -> torch.Tensor:
    return (x.detach().abs() * 7).long().flatten()[: x.shape[0]] % max(classes, 1)


# (name, function of (x, aux) -> loss-like tensor); x is the differentiable input
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "softmax": lambda x, a: torch.softmax(x, -1) * a,
    "log_softmax": lambda x, a: F.log_softmax(x, 0) * a,
    "gelu": lambda x, a: F.gelu(x) * a,
    "gelu_tanh": lambda x, a: F.gelu(x, approximate="tanh") * a,
    "masked_fill": lambda x, a: x.masked_fill(~(a > 0), -2.5) * a,
    "layer_norm": lambda x, a: F.layer_norm(
        x, (x.shape[-1],), a.sum(0) * 0.1 + 1.0, a.sum(0) * 0.05, eps=1e-4
    ),
    "layer_norm_no_affine": lambda x, a: F.layer_norm(x, (x.shape[-1],)) * a,
    "cross_entropy": lambda x, a: F.cross_entropy(x, _labels(a, x.shape[-1]), reduction="sum"),
    "cross_entropy_mean": lambda x, a: F.cross_entropy(x, _labels(a, x.shape[-1])),
    "embedding": lambda x, a: F.embedding(_labels(a, x.shape[0]), x) * 1.5,
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_and_backward_match_eager_in_cpp(name, shape):
    torch.manual_seed(0)
    x = SHAPES[shape]()
    if name in ("cross_entropy_mean", "embedding") and x.shape[0] == 0:
        pytest.skip("mean over no rows / embedding of a 0-row table: not a training input")
    a = torch.randn(x.shape).abs() + 0.1 if name != "masked_fill" else torch.randn(x.shape)
    r = on_device_and_eager(OPS[name], x, a)
    torch.testing.assert_close(r["out"], r["want_out"], equal_nan=True)
    torch.testing.assert_close(r["grad"], r["want_grad"], equal_nan=True)
    # (layer norm with no weight gradient wanted, or no weight: native_layer_norm_backward has
    # absent outputs, recorded in C++ too: no getitem node, an undefined tensor)
    py = {k: v for k, v in r["python"].items() if k in CPP_OPS}
    assert py == {}, f"table ops through the Python fallback: {py}"


def _training_program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The new table ops called directly (no autograd): single and multi-output."""
    aten = torch.ops.aten
    h = x @ w  # (4, 5)
    s = aten._softmax(h, 1, False)
    ls = aten._log_softmax(h, 1, False)
    g = aten._softmax_backward_data(ls, s, 1, torch.float32)
    gl = aten._log_softmax_backward_data(g, ls, 1, torch.float32)
    gb = aten.gelu_backward(gl, h, approximate="tanh")
    m = aten.masked_fill(gb, aten.bitwise_not(h > 0), -3.0)
    y, mean, rstd = aten.native_layer_norm(m, [5], w[0], w[1], 1e-5)
    gi, gw, gbias = aten.native_layer_norm_backward(y, m, [5], mean, rstd, w[0], w[1], [True] * 3)
    idx = (h > 0).long()[:, 0] + 2
    loss, total = aten.nll_loss_forward(ls, idx, None, 1, -100)
    gn = aten.nll_loss_backward(loss, ls, idx, None, 1, -100, total)
    e = aten.embedding(w.t(), idx)
    ge = aten.embedding_dense_backward(e, idx, 5, -1, False)
    return y, gi, gw, gbias, gn, ge, mean, rstd


def test_same_graph_as_the_python_recorder():
    """The converted graph (C++ recipes, getitem nodes of the multi-output ops) is node for node
    the Python recorder's graph of the same program: equal structural hash."""
    check_same_graph_as_the_python_recorder(
        _training_program,
        (torch.randn(4, 3), torch.randn(3, 5)),
        CPP_OPS,
    )


class _TinyLM(torch.nn.Module):
    """Embedding, layer norm, causal softmax attention (masked_fill), GELU MLP, tied head."""

    def __init__(self, vocab: int = 11, d: int = 8, t: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(t, d)
        self.ln1 = torch.nn.LayerNorm(d)
        # no bias: the key's bias has a zero true gradient (softmax ignores a per-row shift), and
        # Adam's first step turns its rounding noise (~1e-8) into +-lr in either implementation
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.proj = torch.nn.Linear(2 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.emb(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln1(h)).chunk(3, -1)
        att = (q @ k.transpose(-1, -2)) * 0.25
        att = torch.softmax(att.masked_fill(~self.mask[:t, :t], float("-inf")), -1)
        h = h + att @ v
        h = h + self.proj(F.gelu(self.fc(self.ln2(h))))
        return h @ self.emb.weight.t()


def test_steady_training_step_records_these_ops_in_cpp_and_matches_eager():
    ref = _TinyLM()
    lz = copy.deepcopy(ref).to(dev)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_l = torch.optim.AdamW(lz.parameters(), lr=1e-2)
    kiln.mark_step()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, 11, (3, 5), generator=g)
        tgt = torch.randint(0, 11, (3, 5), generator=g)
        before = dict(native.python_ops())
        loss_l = F.cross_entropy(lz(idx.to(dev)).flatten(0, 1), tgt.to(dev).flatten())
        loss_l.backward()
        py = python_calls_since(before, CPP_OPS)
        kiln.mark_step()
        loss_r = F.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten())
        loss_r.backward()
        torch.testing.assert_close(loss_l.cpu(), loss_r.detach(), msg=f"loss, step {step}")
        for (pname, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(pl.grad.cpu(), pr.grad, msg=f"grad {pname}, {step}")
        opt_l.step()
        opt_l.zero_grad()
        kiln.mark_step()
        opt_r.step()
        opt_r.zero_grad()
        for (pname, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(pl.detach().cpu(), pr.detach(), msg=f"{pname}, {step}")
        assert py == {}, f"step {step}: table ops through the Python fallback: {py}"
