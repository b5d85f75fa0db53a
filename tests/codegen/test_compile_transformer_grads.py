"""A transformer block's training step in compile mode against eager: the layout rewrites of its
backward (the q/k/v gradient ``cat`` read through strides, bias-gradient column sums fused into the
kernel that computes the gradient) and the layer-norm backward kernel, over odd and real sizes,
a non-contiguous input, one-element dims and an empty batch; the attention glue computed in the
layout its readers want (kiln/passes/sink_permute.py: no permuted kernel output is reshaped or
concatenated by a copy).  Forward, gradients and updated parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.passes.sink_permute import LAYOUT_READERS
from kiln.runtime.compiler import executables


class Block(nn.Module):
    """nanoGPT's block: fused q/k/v projection, causal masked_fill attention, GELU MLP."""

    def __init__(self, c: int, heads: int, t: int) -> None:
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.out = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).view(1, 1, t, t)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.h, C // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // self.h) ** 0.5)
        att = F.softmax(att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    opt.zero_grad()
    loss = model(x).square().mean() if x.numel() else model(x).sum()
    loss.backward()
    opt.step()
    return loss.detach()


def _fused_column_sums() -> int:
    """Column-sum kernels that compute more than the sum (the gradient it sums, too)."""
    kernels = [k for e in executables() for k in e.info.get("kernels", [])]
    return sum(1 for k in kernels if k["kind"] == "cols" and len(k["members"]) > 1)


def _computed_then_permuted_for_a_copy() -> int:
    """Permutes of a computed value (a kernel's output, or an elementwise op's) that only
    reshapes or a ``cat`` read: each is a copy the permute-sinking pass should have removed."""
    count = 0
    for e in executables():
        g = e.graph
        for i, n in enumerate(g.nodes):
            if n.op != "permute.default":
                continue
            src = g.nodes[n.inputs[0]]
            if src.op == "getitem":
                src = g.nodes[src.inputs[0]]
            computed = src.op == "fused" or src.category.value == "elementwise"
            users = g.users[i]
            if computed and users and all(g.nodes[u].op in LAYOUT_READERS for u in users):
                count += 1
    return count


@pytest.mark.parametrize(
    "shape,heads,layout",
    [
        ((2, 7, 20), 4, "transposed"),
        ((8, 64, 128), 4, "contiguous"),
        ((1, 1, 6), 1, "contiguous"),
        ((3, 5, 12), 3, "transposed"),
        ((0, 5, 12), 3, "contiguous"),
    ],
)
def test_block_step_matches_eager(shape, heads, layout) -> None:
    torch.manual_seed(0)
    B, T, C = shape
    eager = Block(C, heads, T)
    compiled = copy.deepcopy(eager)
    # SGD: the key bias's gradient is zero up to rounding (softmax ignores a per-row shift), and
    # Adam would turn that rounding noise into a full-size update of either sign
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, compiled)]
    step = torch.compile(_step, backend="kiln")
    torch._dynamo.reset()
    kiln.metrics.reset()
    for i in range(2):
        x = torch.randn(shape)
        if layout == "transposed":  # the same values, read through strides
            x = torch.randn(T, B, C).transpose(0, 1)
        want = _step(eager, opts[0], x)
        got = step(compiled, opts[1], x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (n, a), b in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    assert not kiln.metrics.counters()["fallbacks"]
    assert _computed_then_permuted_for_a_copy() == 0
    if B and kiln.config.backend == "cpp":
        # the bias gradients of the MLP's two linears: each column sum rides in the kernel that
        # computes the gradient (GELU's backward, the residual add); with the rewrite off: none
        assert _fused_column_sums() >= 2
