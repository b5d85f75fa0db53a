"""A steady lazy step on the kiln device with the native recorder (``config.lazy_recorder =
"native"``): per-step costs that must not grow with the number of steps run, and values against
eager.

- The memory statistics' list of storages holding data (``holding``, walked by ``held_bytes`` at
  every step) lists each storage once: a parameter updated in place is the same storage every
  step, and was listed again at every cut, so the walk grew by one entry per parameter per step.
- A step with a data-dependent op (transformers' ``.item()`` / ``.all()`` checks) does not keep
  its tensors alive: the shape cache re-raised one cached exception object for such an op every
  step, and each raise added that step's frames (and so its locals: every forward tensor) to the
  exception's traceback -- with both recorders.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln.frontends.lazy import native
from kiln.frontends.lazy.shapes import infer_typed

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
    # tensors of earlier tests still waiting in reference cycles are freed now, not mid-test
    # (CI saw 64 bytes of them freed between the baseline and the check)
    gc.collect()
    kiln.mark_step()
    gc.collect()
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


def test_a_cached_meta_failure_is_raised_without_the_earlier_tracebacks() -> None:
    x = torch.randn(3)

    def to_meta(a):
        return a.to("meta") if isinstance(a, torch.Tensor) else a

    depths = []
    for _ in range(4):
        with pytest.raises(RuntimeError, match="meta") as info:
            infer_typed(torch.ops.aten._local_scalar_dense.default, (x,), {}, to_meta)
        tb, n = info.value.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        depths.append(n)
        assert info.value.__context__ is None
    # the same depth every time (it grew by the raising frames per raise)
    assert depths[1:] == [depths[1]] * 3, depths


@pytest.mark.parametrize("recorder", ["native", "python"])
def test_a_data_dependent_check_in_a_step_does_not_keep_the_step_alive(recorder: str) -> None:
    before = kiln.config.lazy_recorder
    kiln.config.update(lazy_recorder=recorder)
    try:
        w = torch.randn(5, 3).to(dev)
        refs = []

        def step(seed: int) -> float:
            x = torch.full((7, 5), 0.25 * seed).to(dev)
            h = torch.relu(x @ w)  # an intermediate this frame holds to its end
            refs.append(weakref.ref(h))
            out = h * 2.0
            if bool((h >= 0).all()):  # a forced sync: `all`'s value, `.item()` on it
                out = out + 1.0
            return float(out.sum())

        got = [step(s) for s in range(1, 5)]
        kiln.mark_step()
        gc.collect()
        alive = [r() is not None for r in refs]
        assert not any(alive), alive
        wc = w.cpu()
        want = [
            float((torch.relu(torch.full((7, 5), 0.25 * s) @ wc) * 2.0 + 1.0).sum())
            for s in range(1, 5)
        ]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    finally:
        kiln.config.update(lazy_recorder=before)
