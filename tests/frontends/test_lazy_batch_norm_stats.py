"""Batch norm's running statistics on the kiln device, against eager: updated once per call
whether the output is used, discarded, or read before ``mark_step()`` (kiln/frontends/lazy/
batch_norm.py).  Before, a discarded output lost the update (``swa_utils.update_bn`` left every
layer at mean 0 / var 1) and an output read early applied it twice."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln

DEV = kiln.device()


def _use(kind: str, y: torch.Tensor) -> torch.Tensor | None:
    """What the program does with a batch norm's output before the step ends."""
    if kind == "discard":
        return None
    if kind == "keep":
        return y
    if kind == "cpu":
        return y.cpu()
    if kind == "item":
        y.sum().item()
        return y
    raise ValueError(kind)


def _stats(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in m.state_dict().items()}


def _compare(make: Callable[[], nn.Module], xs: list[torch.Tensor], use: str) -> None:
    torch.manual_seed(0)
    ref = make().train()
    lazy = copy.deepcopy(ref).to(DEV)
    for x in xs:
        _use(use, ref(x))
        _use(use, lazy(x.to(DEV)))
        kiln.mark_step()
    got, want = _stats(lazy), _stats(ref)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


MODULES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "batch_norm_1d": (lambda: nn.BatchNorm1d(4), (8, 4)),
    "batch_norm_2d": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "batch_norm_momentum_none": (lambda: nn.BatchNorm1d(4, momentum=None), (8, 4)),
    "instance_norm_tracked": (lambda: nn.InstanceNorm1d(4, track_running_stats=True), (3, 4, 7)),
    "linear_then_batch_norm": (lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)), (8, 5)),
}


@pytest.mark.parametrize("use", ["discard", "keep", "cpu", "item"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_running_statistics_as_eager(name: str, use: str) -> None:
    make, shape = MODULES[name]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, generator=g) * 2 + 0.5 for _ in range(3)]
    _compare(make, xs, use)


def test_functional_batch_norm_with_buffers_read_early() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, generator=g)
    stats = {d: (torch.zeros(3, device=d), torch.ones(3, device=d)) for d in ("cpu", DEV)}
    for d, (rm, rv) in stats.items():
        F.batch_norm(x.to(d), rm, rv, training=True, momentum=0.3).cpu()
    kiln.mark_step()
    for a, b in zip(stats[DEV], stats["cpu"]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-7)


def test_swa_update_bn_matches_eager() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    lazy = copy.deepcopy(model).to(DEV)
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(5, 6, generator=g) for _ in range(4)]
    torch.optim.swa_utils.update_bn(batches, model)
    torch.optim.swa_utils.update_bn([b.to(DEV) for b in batches], lazy, device=DEV)
    kiln.mark_step()
    got, want = _stats(lazy), _stats(model)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_training_steps_with_the_batch_norm_output_read_mid_step() -> None:
    """Forward, the first layer's output read with .cpu(), backward, SGD: losses, parameters and
    statistics as eager after three steps."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 3))
    lazy = copy.deepcopy(model).to(DEV)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, lazy)]
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        losses = []
        for m, opt, d in ((model, opts[0], "cpu"), (lazy, opts[1], DEV)):
            h = m[0](x.to(d))
            h.cpu()
            loss = F.cross_entropy(m[1](h), y.to(d))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        kiln.mark_step()
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
    got, want = _stats(lazy), _stats(model)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_evaluation_mode_leaves_the_statistics() -> None:
    torch.manual_seed(7)
    bn = nn.BatchNorm1d(4)
    bn.running_mean.uniform_()
    lazy = copy.deepcopy(bn).to(DEV).eval()
    bn.eval()
    x = torch.randn(5, 4)
    torch.testing.assert_close(lazy(x.to(DEV)).cpu(), bn(x), rtol=1e-6, atol=1e-6)
    kiln.mark_step()
    torch.testing.assert_close(_stats(lazy)["running_mean"], _stats(bn)["running_mean"])
