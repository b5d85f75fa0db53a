"""Elementwise kernels keep a dense non-contiguous layout (channels-last) instead of copying.

A flat kernel (``KernelSpec.flat``: element i of every output from element i of every full input,
no broadcast; lane kernels too) whose full inputs share one dense layout reads them as stored and
makes its outputs in that layout, as eager's elementwise ops do.  Before 2026-12-05 every such
input was copied to contiguous first and the outputs were contiguous, so a channels-last CNN
copied each activation around every ReLU / residual add and each convolution then converted it
back: a ResNet-18-style step (batch 16, 32 x 32, channels-last, SGD) ran at 0.82x eager, the
copies (``aten::copy_``) 74 ms a step in a profile (eager's 5 ms), the optimizer's lane kernel
copying every channels-last weight.  Values are unchanged; mixed layouts, broadcasts and non-dense inputs take
the copying path as before.  Both executors: the native launcher and the Python one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from optim_cases import loss_and_grads_step
from torch import nn

import kiln

CL = torch.channels_last
EXECUTORS = pytest.mark.parametrize("launcher", [True, False], ids=["native", "python"])


def _compiled(fn: Callable, launcher: bool) -> Callable:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kiln")

    def run(*args: torch.Tensor) -> object:
        with kiln.config.scoped(launcher=launcher, disk_cache=False):
            return compiled(*args)

    return run


def _chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2 + y) - y.sigmoid()


@EXECUTORS
@pytest.mark.parametrize(
    "layout",
    ["channels_last", "transposed", "mixed", "expanded", "zero_size", "contiguous"],
)
def test_an_elementwise_chain_on_any_layout_matches_eager(launcher: bool, layout: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, 3, generator=g)
    y = torch.randn(4, 6, 5, 3, generator=g)
    if layout == "channels_last":
        x, y = x.contiguous(memory_format=CL), y.contiguous(memory_format=CL)
    elif layout == "transposed":
        x, y = x.transpose(1, 3), y.transpose(1, 3)
    elif layout == "mixed":  # one channels-last, one contiguous: copied as before
        x = x.contiguous(memory_format=CL)
    elif layout == "expanded":  # not dense: copied as before
        x = torch.randn(1, 6, 5, 3, generator=g).expand(4, 6, 5, 3)
    elif layout == "zero_size":
        x, y = x[:0].contiguous(memory_format=CL), y[:0].contiguous(memory_format=CL)
    want = _chain(x, y)
    got = _compiled(_chain, launcher)(x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if layout in ("channels_last", "transposed", "contiguous"):
        # the output in the inputs' layout, as eager makes it
        assert got.stride() == want.stride()


def _bias_add(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(x + b[:, None, None])  # a broadcast: not flat


@EXECUTORS
def test_a_broadcast_kernel_on_channels_last_input_still_matches(launcher: bool) -> None:
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=CL)
    b = torch.randn(8)
    torch.testing.assert_close(_compiled(_bias_add, launcher)(x, b), _bias_add(x, b))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)) + h)  # a residual add
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


@EXECUTORS
def test_a_channels_last_conv_net_trains_as_eager_and_keeps_its_layout(launcher: bool) -> None:
    torch.manual_seed(0)
    base = _Net().to(memory_format=CL)
    g = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=CL),
            torch.randint(0, 5, (4,), generator=g),
        )
        for _ in range(3)
    ]

    def train(compiled: bool) -> tuple[list, nn.Module]:
        model = copy.deepcopy(base)
        step = loss_and_grads_step(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        )
        run = _compiled(step, launcher) if compiled else step
        return [run(x, y) for x, y in data], model

    want, eager_model = train(False)
    got, kiln_model = train(True)
    for (gl, gg), (wl, wg) in zip(got, want):
        torch.testing.assert_close(gl, wl, rtol=1e-5, atol=0)
        for name in wg:
            torch.testing.assert_close(gg[name], wg[name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), q in zip(kiln_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
        assert p.stride() == q.stride(), name  # channels-last weights stay channels-last
