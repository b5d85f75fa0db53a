"""Group norm after a channels-last convolution, trained on the kiln device and in compile mode.

ATen's CPU ``native_group_norm_backward`` reads dY in X's memory format: a channels-last X with a
contiguous dY (or the reverse) gives wrong gradients, silently (torch 2.13).  Eager never hands it
that mix, a Kiln graph did: the convolution's output (X) stays channels-last in ATen while the
gradient reaching the group norm comes from a Kiln kernel, contiguous -- every gradient before
the group norm was wrong by ~100% on the kiln device.  The executors now copy that op's
arguments to one layout (``aten_call.ARG_LAYOUT``); here losses, every gradient and every
parameter against eager, on channels-last inputs made two ways, at a small and a real size."""

from __future__ import annotations

import copy

import pytest
import torch
from _training_compare import assert_same_training
from torch import nn

import kiln
from kiln.config import config

DEV = kiln.device()


def _block(cin: int, c: int, groups: int) -> nn.Module:
    # a diffusion U-Net's residual-block start: convolution, group norm, SiLU, convolution
    return nn.Sequential(
        nn.Conv2d(cin, c, 3, padding=1),
        nn.GroupNorm(groups, c),
        nn.SiLU(),
        nn.Conv2d(c, cin, 3, padding=1),
    )


def _train(model: nn.Module, xs: list[torch.Tensor], mode: str) -> tuple:
    dev = DEV if mode == "lazy" else torch.device("cpu")
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    if mode == "compile":
        torch._dynamo.reset()
        step = torch.compile(step, backend="kiln")
    losses, grads = [], []
    for x in xs:
        loss = step(x.to(dev))
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if mode == "lazy":
            kiln.mark_step()
        losses.append(loss.item())
    return losses, grads, [p.detach().cpu() for p in model.parameters()]


def _channels_last(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "memory_format":
        return x.contiguous(memory_format=torch.channels_last)
    return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # NHWC data viewed as NCHW


def _compare(base: nn.Module, xs: list[torch.Tensor], mode: str) -> None:
    want = _train(copy.deepcopy(base), xs, "eager")
    got = _train(copy.deepcopy(base), xs, mode)
    assert_same_training(got, want)


@pytest.mark.parametrize("how", ["memory_format", "permuted"])
@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "python-executor"])
def test_group_norm_after_channels_last_conv_on_the_device(how, launcher, monkeypatch):
    monkeypatch.setattr(config, "launcher", launcher)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = [_channels_last(torch.randn(2, 4, 8, 8, generator=g), how) for _ in range(2)]
    _compare(_block(4, 8, 2), xs, "lazy")


def test_group_norm_after_channels_last_conv_at_a_real_size():
    # 64 channels in 8 groups over 32x32 images, a batch of 4
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = [
        _channels_last(torch.randn(4, 16, 32, 32, generator=g), "memory_format") for _ in range(2)
    ]
    _compare(_block(16, 64, 8), xs, "lazy")


@pytest.mark.one_recorder
def test_group_norm_after_channels_last_conv_in_compile_mode():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = [_channels_last(torch.randn(2, 4, 8, 8, generator=g), "memory_format") for _ in range(2)]
    _compare(_block(4, 8, 2), xs, "compile")


@pytest.mark.one_recorder
def test_group_norm_backward_call_takes_mixed_layouts():
    # the executors' call of the op itself: X channels-last, dY contiguous, and the reverse
    from kiln.codegen.cpp.aten_call import _METHODS

    call = _METHODS["native_group_norm_backward.default"]
    aten = torch.ops.aten
    torch.manual_seed(0)
    n, c, h, w = 2, 8, 6, 6
    x, dy = torch.randn(n, c, h, w), torch.randn(n, c, h, w)
    gamma = torch.randn(c)
    _, mean, rstd = aten.native_group_norm(x, gamma, None, n, c, h * w, 2, 1e-5)
    want = aten.native_group_norm_backward(dy, x, mean, rstd, gamma, n, c, h * w, 2, [True] * 3)
    cl = torch.channels_last
    for xx, dd in [(x.contiguous(memory_format=cl), dy), (x, dy.contiguous(memory_format=cl))]:
        got = call(dd, xx, mean, rstd, gamma, n, c, h * w, 2, [True] * 3)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
