"""What training loops call around ``optimizer.step()`` on the kiln device, against eager CPU:
gradient clipping (``clip_grad_norm_`` / ``clip_grad_value_``, whose default foreach path writes
the gradients in place with ``_foreach_*`` ops while autograd left some of them as views) stays
in the step's graph with no forced sync, and fused Adam / AdamW (in-place ops writing lists of
tensors) train as eager does.  Both recorders (tests/frontends/conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import kiln

STEPS = 3


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, dev, clip) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        loss = (model(x.to(dev)) - y.to(dev)).square().mean()
        loss.backward()
        if clip is not None:
            clip(model.parameters())
        opt.step()
        opt.zero_grad()
        if dev != "cpu":
            kiln.mark_step()
        losses.append(loss.item())
    return losses


CLIPS = {
    "norm": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05),
    "value": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_gradient_clipping_stays_in_the_step(clip: str) -> None:
    ref = _mlp()
    lz = copy.deepcopy(ref).to(kiln.device())
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.5), "cpu", CLIPS[clip])
    kiln.metrics.reset()
    losses = _train(lz, torch.optim.SGD(lz.parameters(), lr=0.5), kiln.device(), CLIPS[clip])
    c = kiln.metrics.counters()
    assert c["syncs"] == {}  # (the Python recorder counts each loss.item() as a fallback)
    assert not [op for op in c["fallbacks"] if op.startswith("_foreach")]
    assert c["graphs_executed"] == STEPS  # one graph a step
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for a, b in zip(ref.parameters(), lz.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1),
    ],
    ids=["adamw", "adam-amsgrad"],
)
def test_fused_adam_trains_as_eager(make) -> None:
    ref = _mlp()
    lz = copy.deepcopy(ref).to(kiln.device())
    ref_losses = _train(ref, make(ref.parameters()), "cpu", None)
    losses = _train(lz, make(lz.parameters()), kiln.device(), None)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for a, b in zip(ref.parameters(), lz.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-7)
