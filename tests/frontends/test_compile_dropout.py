"""``dropout(x, p=0)`` -> ``x`` on Dynamo's graph (kiln/frontends/compile/dropout.py): which calls
go, that a compiled training step equals eager, and that it saves no more for backward than eager
(AOTAutograd's decomposition had made the dropout a copy that was saved beside its input)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _dynamo_rewrites import rewritten
from torch import nn

import kiln
from kiln.frontends.compile.dropout import drop_zero_dropout


def _ops_after(fn, *args):
    """(calls removed, remaining call targets' names) for ``fn`` captured by Dynamo."""
    seen = rewritten(drop_zero_dropout, fn, *args)
    return seen["n"], seen["ops"]


def test_zero_probability_dropouts_go_others_stay():
    drop0 = nn.Dropout(0.0)  # a module in training mode, as in a training step
    x = torch.randn(4, 5)

    def fn(x):
        a = F.dropout(x.exp(), 0.0, True)
        b = torch.dropout(a.sin(), 0, True)
        c = F.dropout(b, p=0.0, training=True, inplace=True)
        return drop0(c) * 2

    n, ops = _ops_after(fn, x)
    assert n == 4
    assert "dropout" not in ops, ops
    n, ops = _ops_after(lambda x: F.dropout(x, 0.1, True) + F.dropout(x), x)
    assert n == 0
    assert ops.count("dropout") == 2


def _attention_block(seed: int) -> nn.Module:
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.drop = nn.Dropout(0.0)
            self.register_buffer("mask", torch.tril(torch.ones(16, 16, dtype=torch.bool)))

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, 2)
            q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in (q, k, v))
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(8))
            a = a.masked_fill(~self.mask[:T, :T], float("-inf"))
            p = self.drop(F.softmax(a, dim=-1))
            return self.drop((p @ v).transpose(1, 2).reshape(B, T, C))

    return Block()


def _saved_bytes(fn, x) -> int:
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.sum().backward()
    return sum(sizes)


@pytest.mark.parametrize("seq", [16, 0], ids=["seq16", "zero_size"])
def test_attention_step_matches_eager_and_saves_no_more(seq):
    eager, comp = _attention_block(0), _attention_block(0)
    # SGD: k's bias has a gradient of zero up to rounding (softmax ignores a shift of every
    # score), which Adam's normalisation would blow up to +-lr in either mode
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(comp.parameters(), lr=0.1, momentum=0.9)
    torch._dynamo.reset()

    def step(model, opt, x):
        loss = model(x).square().mean() if seq else model(x).sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        return loss, grads

    cstep = torch.compile(step, backend="kiln")
    before = kiln.metrics.get("dropout_p0_removed")
    for i in range(3):
        x = torch.randn(2, seq, 32).transpose(0, 1).contiguous().transpose(0, 1)
        (lc, gc), (le, ge) = cstep(comp, opt_c, x), step(eager, opt_e, x)
        torch.testing.assert_close(lc, le)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kiln.metrics.get("dropout_p0_removed") > before
    for a, b in zip(comp.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if seq:
        # what the compiled forward saves for backward: with the dropout gone, less than with
        # the pass off (AOTAutograd's copy of the probabilities was saved beside them)
        x = torch.randn(2, seq, 32)
        saved = {}
        for off in ("dropout", ""):
            kiln.config.update(disable_passes=off)
            try:
                torch._dynamo.reset()
                saved[off] = _saved_bytes(torch.compile(comp, backend="kiln"), x)
            finally:
                kiln.config.update(disable_passes="")
        assert saved[""] < saved["dropout"] <= _saved_bytes(eager, x)
