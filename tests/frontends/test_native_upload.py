"""``batch.to(kiln)`` on the native recorder: its allocation (``empty`` / ``empty_strided`` on the
kiln device) is replayed from the first call with the same arguments (``lazy/device.py``), without
the factory's Python path; the values, geometry and dtypes are the eager tensor's, and a change of
any argument takes the full path again."""

from __future__ import annotations

import importlib

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln

lazy_device = importlib.import_module(
    "kiln.frontends.lazy.device"
)  # (the package's name is a function)

dev = kiln.device()
pytestmark = pytest.mark.usefixtures("native_device")


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 100, (4, 64), generator=g),
        torch.randn(3, 5, generator=g),
        torch.randn(5, 3, generator=g).t(),  # non-contiguous: empty_strided with its strides
        torch.randn(2, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last),
        torch.randn(0, 7, generator=g),  # zero-size
        torch.randn(6, generator=g).to(torch.float64),
        torch.tensor(3.5),
    ]


@pytest.mark.parametrize("k", range(len(_batches())))
def test_uploads_are_replayed_with_the_same_values_and_geometry(k, monkeypatch):
    lazy_device._replay.clear()
    slow = []
    full_path = lazy_device._native_factory
    monkeypatch.setattr(
        lazy_device, "_native_factory", lambda *a: slow.append(a[1]) or full_path(*a)
    )
    x = _batches()[k]
    outs = []
    for step in range(3):
        y = (x + step).to(dev)
        outs.append((y, x + step))
        assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == x.stride()
        kiln.mark_step()
    # the allocation went through the factory's path once, then was replayed
    assert len(slow) == 1 and slow[0] in lazy_device._REPLAYED
    for y, want in outs:
        got = y.cpu()
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_empty_on_the_device_keeps_its_arguments():
    lazy_device._replay.clear()
    a = torch.empty(3, 4, device=dev)
    b = torch.empty(3, 4, device=dev)
    c = torch.empty(4, 3, device=dev, dtype=torch.float64)
    d = torch.empty_strided((2, 3), (1, 2), device=dev)
    assert a.shape == b.shape == (3, 4) and a.dtype == b.dtype == torch.float32
    assert c.shape == (4, 3) and c.dtype == torch.float64
    assert d.stride() == (1, 2)
    a.fill_(1.0)
    b.fill_(2.0)  # two tensors, two storages: a replayed allocation is a new tensor
    kiln.mark_step()
    assert a.cpu().eq(1.0).all() and b.cpu().eq(2.0).all()
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)
        try:
            e = torch.empty(3, 4, device=dev)  # the default dtype is part of the call
        finally:
            torch.set_default_dtype(torch.float32)
    assert e.dtype == torch.float64
    kiln.mark_step()
