"""A steady lazy step on the kiln device with the native recorder (``config.lazy_recorder =
"native"``): per-step costs that must not grow with the number of steps run, and values against
eager.

- The memory statistics' list of storages holding data (``holding``, walked by ``held_bytes`` at
  every step) lists each storage once: a parameter updated in place is the same storage every
  step, and was listed again at every cut, so the walk grew by one entry per parameter per step.
"""

from __future__ import annotations

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln.frontends.lazy import native

dev = kiln.device()
pytestmark = pytest.mark.usefixtures("native_device")


@pytest.mark.parametrize("shape", [(5, 3), (0, 4), (1,), ()])
def test_storages_updated_in_place_every_step_are_listed_once(shape: tuple[int, ...]) -> None:
    mod = native.load()
    torch.manual_seed(0)
    cpu = [torch.randn(shape) for _ in range(6)]
    params = [t.to(dev) for t in cpu]
    kiln.mark_step()
    counts = []
    for _ in range(12):
        for p, c in zip(params, cpu):
            p.mul_(0.5).add_(1.0)
            c.mul_(0.5).add_(1.0)
        kiln.mark_step()
        counts.append(mod.holding_entries())
    # the same six storages every step: the list does not grow after the first step
    assert counts[-1] == counts[1], counts
    for p, c in zip(params, cpu):
        torch.testing.assert_close(p.cpu(), c)
    want = sum(c.numel() * c.element_size() for c in cpu)
    assert torch.kiln.memory_allocated() >= want


def test_memory_allocated_counts_each_in_place_updated_buffer_once() -> None:
    kiln.mark_step()
    base = torch.kiln.memory_allocated()
    ps = [torch.zeros(7, 3).to(dev) for _ in range(4)]
    kiln.mark_step()
    for _ in range(5):
        for p in ps:
            p.add_(1.0)
        kiln.mark_step()
    assert torch.kiln.memory_allocated() - base == 4 * 7 * 3 * 4
    for p in ps:
        torch.testing.assert_close(p.cpu(), torch.full((7, 3), 5.0))
