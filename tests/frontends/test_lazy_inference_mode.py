"""``torch.inference_mode()`` on the kiln device, as evaluation loops use it.

The native recorder made every view a fresh tensor constructed under the current mode, so a view
of a parameter taken under ``inference_mode`` (``F.linear``'s ``weight.t()``) was an inference
tensor that autograd's view tracking then tried to give its base's version counter: ``RuntimeError:
Cannot set version_counter for inference tensor`` on any ``nn.Linear`` forward.  Views are now
made as ATen makes them (the base's key set), and a detached copy of an inference tensor keeps no
version counter.  Here outputs against eager, ``is_inference`` as eager reports it, and training
afterwards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln

DEV = kiln.device()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_evaluation_under_a_grad_mode_matches_eager(mode):
    m = _model().eval()
    md = copy.deepcopy(m).to(DEV)
    x = torch.randn(3, 8)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with ctx():
        want = m(x)
        got = md(x.to(DEV))
        kiln.mark_step()
        assert got.is_inference() == want.is_inference()
        torch.testing.assert_close(got.cpu(), want)


def test_views_under_inference_mode_are_what_eager_makes():
    w = nn.Parameter(torch.randn(4, 6))
    wd = nn.Parameter(w.detach().to(DEV))
    with torch.inference_mode():
        x = torch.randn(4, 6)
        xd = x.to(DEV)
        pairs = [
            (w.t(), wd.t()),  # a view of a normal tensor: normal
            (w[1:], wd[1:]),
            (x.t(), xd.t()),  # a view of an inference tensor: inference
            (x.view(24), xd.view(24)),
            (w.t() * 2, wd.t() * 2),  # a new value: inference
        ]
        for want, got in pairs:
            assert got.is_inference() == want.is_inference()
            assert got.requires_grad == want.requires_grad
        kiln.mark_step()
        for want, got in pairs:
            torch.testing.assert_close(got.cpu(), want)


def test_training_after_an_inference_mode_evaluation():
    m = _model()
    md = copy.deepcopy(m).to(DEV)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        md(x.to(DEV))
        kiln.mark_step()
    opt = torch.optim.SGD(md.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for model, o, dev in ((md, opt, DEV), (m, ref_opt, torch.device("cpu"))):
        model(x.to(dev)).pow(2).mean().backward()
        o.step()
        if dev == DEV:
            kiln.mark_step()
    for a, b in zip(md.parameters(), m.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)
