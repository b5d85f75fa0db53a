"""The optimizers' foreach ops on the kiln device with the native recorder as its recorder
(``config.lazy_recorder = "native"``): ``_foreach_*`` calls recorded in C++ (``native/foreach.h``)
as per-tensor ops, in-place ones written back, with no Python fallback call in a steady step; loss,
gradients, updated parameters and optimizer state against eager."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln import metrics
from kiln.frontends.lazy import native

dev = kiln.device()


pytestmark = pytest.mark.usefixtures("native_device")


class _Odd(torch.nn.Module):
    """Parameters of odd shapes: a scalar, a size-0 matrix, a (3, 1, 5) block, a 7-vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 7) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(7))
        self.s = torch.nn.Parameter(torch.tensor(0.7))
        self.z = torch.nn.Parameter(torch.randn(0, 3))
        self.o = torch.nn.Parameter(torch.randn(3, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w + self.b) * self.s
        return h.sum(1) + self.z.sum() + (self.o * self.o).mean()


OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_steps_are_recorded_in_cpp_and_match_eager(name):
    ref = _Odd()
    lz = copy.deepcopy(ref).to(dev)
    assert all(native.is_native(p) for p in lz.parameters())
    opt_r, opt_l = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](lz.parameters())
    mod = native.load()
    kiln.mark_step()
    metrics.reset()
    torch.manual_seed(3)
    for step in range(4):
        x, y = torch.randn(9, 16), torch.randn(9)
        loss_r = torch.nn.functional.mse_loss(ref(x), y)
        loss_r.backward()
        loss_l = torch.nn.functional.mse_loss(lz(x.to(dev)), y.to(dev))
        loss_l.backward()
        kiln.mark_step()
        torch.testing.assert_close(loss_l.cpu(), loss_r, msg=f"loss, step {step}")
        for (pname, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(pl.grad.cpu(), pr.grad, msg=f"grad {pname}, step {step}")
        opt_r.step()
        opt_r.zero_grad()
        calls, foreach = mod.python_calls(), mod.foreach_calls()
        opt_l.step()
        opt_l.zero_grad()
        assert mod.foreach_calls() > foreach  # the default (foreach) path, recorded in C++
        if step >= 1:  # (the first step makes the state: zeros_like goes through Python)
            assert mod.python_calls() == calls, f"Python fallback calls in step {step}"
        kiln.mark_step()
        for (pname, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(pl.detach().cpu(), pr.detach(), msg=f"{pname}, {step}")
        for sr, sl in zip(opt_r.state.values(), opt_l.state.values()):
            for k, v in sr.items():
                torch.testing.assert_close(sl[k].cpu(), v, msg=f"state {k}, step {step}")
    assert metrics.counters().get("forced_syncs", 0) == 0
    assert metrics.counters()["native_inplace_writes"] > 0


def test_foreach_reads_before_writes_and_aliases_see_the_writes():
    xs = [torch.randn(4, 3), torch.randn(5), torch.randn(0, 2)]
    ls = [x.to(dev) for x in xs]
    alias = ls[0].detach()  # same storage: sees the write
    kiln.mark_step()
    metrics.reset()
    before = [t * 1 for t in ls]  # recorded before the writes: the old values
    halves = torch._foreach_mul(ls, 0.5)  # functional: new tensors
    torch._foreach_addcmul_(ls, ls, ls, value=-0.25)
    torch._foreach_lerp_(ls, halves, 0.3)
    assert metrics.counters().get("forced_syncs", 0) == 0
    kiln.mark_step()
    want = [x.clone() for x in xs]
    torch._foreach_addcmul_(want, want, want, value=-0.25)
    torch._foreach_lerp_(want, torch._foreach_mul(xs, 0.5), 0.3)
    for got, old, x, w in zip(ls, before, xs, want):
        torch.testing.assert_close(got.cpu(), w)
        torch.testing.assert_close(old.cpu(), x)
    torch.testing.assert_close(alias.cpu(), want[0])


def test_a_view_among_the_written_tensors_takes_the_python_path_with_eager_values():
    a, b = torch.randn(4, 3), torch.randn(5)
    la, lb = a.to(dev), b.to(dev)
    kiln.mark_step()
    mod = native.load()
    calls = mod.python_calls()
    torch._foreach_mul_([lb, la[1]], 2.0)  # la[1] is a view: the whole call goes to Python
    assert mod.python_calls() > calls
    a[1].mul_(2.0)
    b.mul_(2.0)
    torch.testing.assert_close(la.cpu(), a)
    torch.testing.assert_close(lb.cpu(), b)


def test_with_the_switch_off_a_foreach_op_is_not_split():
    x = torch.randn(3, 2)
    kiln.config.update(lazy_recorder="python")
    try:
        lx = native.tensor(x)
        mod = native.load()
        foreach = mod.foreach_calls()
        out = torch._foreach_mul([lx], 3.0)
        assert mod.foreach_calls() == foreach
        native.mark_step()
        torch.testing.assert_close(native.cpu(out[0]), x * 3.0)
    finally:
        kiln.config.update(lazy_recorder="native")
