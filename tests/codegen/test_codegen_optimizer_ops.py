"""Generated kernels for the optimizer's pointwise ops (lerp, addcmul, addcdiv) against eager.

The lazy device records AdamW's update as ``lerp`` / ``addcmul`` / ``addcdiv`` calls; these tests
check the fused formulas (ATen's lerp branch on |weight| < 0.5, the ``value`` scalar) through
``torch.compile(backend="kiln")`` forward and backward, and a lazy AdamW training loop.
"""

from __future__ import annotations

import copy

import torch
from kiln_codegen_testlib import check_compiled_vs_eager, on_configured_backend

import kiln


_check = check_compiled_vs_eager


def test_lerp_scalar_both_branches_and_tensor_weight():
    def f(a, b, w):
        return (torch.lerp(a, b, 0.1) * torch.lerp(a, b, 0.9) + torch.lerp(a, b, w)).exp()

    _check(f, torch.randn(13, 37), torch.randn(13, 37), torch.rand(37) * 2 - 0.5)


def test_addcmul_addcdiv_with_value():
    def f(x, a, b):
        y = torch.addcmul(x, a, b, value=0.37)
        return torch.addcdiv(y, a, b.abs() + 1.0, value=-1.7).tanh()

    _check(f, torch.randn(5, 9, 11), torch.randn(5, 9, 11), torch.randn(9, 11))


def test_lazy_adamw_loop_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 3))
    dev = kiln.device()
    lazy = copy.deepcopy(model).to(dev)
    oe = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ol = torch.optim.AdamW(lazy.parameters(), lr=1e-2, weight_decay=0.1)
    xs = [torch.randn(7, 13) for _ in range(4)]
    with on_configured_backend():
        for x in xs:
            for m, o, d in ((model, oe, "cpu"), (lazy, ol, dev)):
                m(x.to(d)).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
            kiln.mark_step()
    for a, b in zip(lazy.parameters(), model.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach())
