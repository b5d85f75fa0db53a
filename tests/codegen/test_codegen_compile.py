"""Forward and backward through ``torch.compile(backend="kiln")`` on the configured backend
(``KILN_BACKEND``; generated kernels with the default, cpp)."""

from __future__ import annotations

import torch
from kiln_codegen_testlib import check_compiled_vs_eager
import torch.nn.functional as F

import kiln  # noqa: F401 - registers the backend


_check = check_compiled_vs_eager


def test_mlp_block_forward_backward():
    def f(x, w, b, g, beta):
        h = F.gelu(x @ w + b)
        h = F.layer_norm(h, (h.shape[-1],), g, beta)
        return torch.tanh(h) * torch.sigmoid(h)

    _check(
        f,
        torch.randn(7, 33),
        torch.randn(33, 65) * 0.2,
        torch.randn(65),
        torch.randn(65),
        torch.randn(65),
    )


def test_attention_softmax_and_loss():
    def f(q, k, tgt):
        att = (q @ k.transpose(-2, -1)) * 0.25
        mask = torch.ones(att.shape[-1], att.shape[-1], dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        logits = att.reshape(-1, att.shape[-1])
        return F.cross_entropy(logits, tgt.reshape(-1), reduction="none")

    q, k = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    _check(f, q, k, torch.randint(0, 9, (2, 9)))


def test_transposed_and_broadcast_inputs():
    def f(x, y, s):
        return torch.relu(x.t() * s + y) - (x.t() / (1.0 + y.abs()))

    _check(f, torch.randn(33, 7), torch.randn(33), torch.randn(7, 1))


def test_adamw_step_matches_eager():
    torch._dynamo.reset()
    ps = [torch.randn(33, 7), torch.randn(7), torch.randn(1023)]
    grads = [torch.randn_like(p) for p in ps]

    def make():
        params = [torch.nn.Parameter(p.clone()) for p in ps]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    pe, oe = make()
    pk, ok = make()
    step_k = torch.compile(ok.step, backend="kiln")
    for _ in range(3):
        oe.step()
        step_k()
    for a, b in zip(pk, pe):
        torch.testing.assert_close(a.detach(), b.detach())
