"""Regressions from the lazy-mode OpInfo sweep (issue 8): as_strided, fft.hfft's backward (conj
views), errors inside a backward pass, autograd's zero tensors."""

from __future__ import annotations

import re
import threading
from typing import ClassVar

import pytest
import torch

import kiln
from kiln.frontends.lazy import backward_thread
from kiln.frontends.lazy import tensor as lazy_tensor
from kiln.frontends.lazy.native import device as native_device

DEV = kiln.device()


@pytest.mark.parametrize(
    "f",
    [
        lambda t: torch.as_strided(t[5:15], (2, 2), (1, 2)),  # the view's own offset
        lambda t: torch.as_strided(t[5:15], (2, 2), (1, 2), 0),  # absolute offsets
        lambda t: torch.as_strided(t[5:15], (2, 2), (1, 2), 10),
        lambda t: torch.as_strided(t.view(4, 5).t()[1:], (3, 2), (2, 3), 1),
        lambda t: torch.as_strided((t.view(4, 5) * 2).t(), (3, 2), (2, 3), 1),  # computed base
        lambda t: torch.as_strided(t, (3, 3), (2, 1), 4).sum(0),
    ],
)
def test_as_strided_on_lazy_views_matches_eager(f):
    base = torch.randn(20)
    torch.testing.assert_close(f(base.to(DEV)).cpu(), f(base))


def test_as_strided_of_a_transferred_partial_view_addresses_the_new_storage():
    # OpInfo's as_strided.partial_views: moving a view to a device copies only its elements into
    # a new storage (as .cuda() does), so offsets address that storage, as in eager on a copy
    x = torch.randn(20)[5:15]
    k = x.to(DEV)
    for args in [((2, 2), (1, 2)), ((2, 2), (1, 2), 0), ((3,), (3,), 1)]:
        want = torch.as_strided(x.clone(), *args)
        torch.testing.assert_close(torch.as_strided(k, *args).cpu(), want, rtol=0, atol=0)
    # past the end of the copy: eager's error, raised at the call (not when the step runs)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 40"):
        torch.as_strided(k, (2, 2), (1, 2), 10)
    with pytest.raises(RuntimeError, match="out of bounds for storage of size 40"):
        torch.as_strided(x.clone(), (2, 2), (1, 2), 10)


def test_fft_hfft_backward_matches_eager():
    # its backward takes view_as_real of a conjugate: lazy conj views are computed values
    x = torch.randn(5, 6, 7)
    g = torch.randn(5, 10, 7)
    xr = x.clone().requires_grad_()
    want = torch.autograd.grad(torch.fft.hfft(xr, n=10, dim=1, norm="ortho"), xr, g)[0]
    xk = x.to(DEV).requires_grad_()
    out = torch.fft.hfft(xk, n=10, dim=1, norm="ortho")
    got = torch.autograd.grad(out, xk, g.to(DEV))[0]
    kiln.mark_step()
    torch.testing.assert_close(got.cpu(), want)


def test_conj_and_view_as_real_on_the_lazy_device():
    z = torch.randn(4, 3, dtype=torch.complex64)
    got = torch.view_as_real(z.to(DEV).conj()).cpu()
    torch.testing.assert_close(got, torch.view_as_real(z.conj().resolve_conj()))


def test_sgn_backward_with_zero_tensors():
    x = torch.randn(5).to(DEV).requires_grad_()
    torch.sgn(x).sum().backward()
    kiln.mark_step()
    assert torch.equal(x.grad.cpu(), torch.zeros(5))


def _plant_failure(monkeypatch, op: str) -> None:
    """Make recording ``aten.<op>`` raise ``ValueError("planted failure")`` where the active
    recorder records it: the Python recorder's ``_dispatch``, or the native recorder's Python
    fallback (the handler recorder.cpp calls for ops outside its C++ table)."""
    if native_device.active():
        from kiln.frontends.lazy.native import fallback

        orig = fallback.Handler.__call__

        def failing(self, qual, overload, vals):
            if qual == f"aten::{op}":
                raise ValueError("planted failure")
            return orig(self, qual, overload, vals)

        monkeypatch.setattr(fallback.Handler, "__call__", failing)
        return
    orig = lazy_tensor._dispatch
    target = getattr(torch.ops.aten, op).default

    def failing(func, args, kwargs):
        if func is target:
            raise ValueError("planted failure")
        return orig(func, args, kwargs)

    monkeypatch.setattr(lazy_tensor, "_dispatch", failing)


def _device_still_works() -> None:
    y = torch.randn(3).to(DEV).requires_grad_()
    y.sin().sum().backward()
    kiln.mark_step()
    torch.testing.assert_close(y.grad.cpu(), y.detach().cpu().cos())


@pytest.mark.parametrize("device_thread", [True, False], ids=["engine_thread", "calling_thread"])
def test_an_error_while_recording_in_backward_raises_instead_of_aborting(
    monkeypatch, device_thread
):
    # A Python exception leaving __torch_dispatch__ on PyTorch's autograd worker thread used to
    # std::terminate() the process (PyTorch's Python device guard); now backward() raises it.
    # The failure is planted where the active recorder records: the Python recorder's _dispatch
    # (aten.cos, sin's backward), the native recorder's Python fallback (aten.cumsum, cumsum's
    # backward: cos is recorded in C++ there; test_a_shape_error... covers the C++ path).
    op = "cumsum" if native_device.active() else "cos"
    x = torch.randn(3).to(DEV).requires_grad_()
    loss = x.cumsum(0).sin().sum()
    before = kiln.metrics.get("backward_errors")
    lazy_tensor.last_backward_error = None
    _plant_failure(monkeypatch, op)
    with (
        torch.autograd.set_multithreading_enabled(device_thread),
        pytest.raises(RuntimeError, match=rf"backward pass failed .*aten.{op}.*planted failure"),
    ):
        loss.backward()
    assert isinstance(lazy_tensor.last_backward_error, ValueError)
    assert kiln.metrics.get("backward_errors") == before + 1
    monkeypatch.undo()
    _device_still_works()


# mm's shape error: the meta kernel's wording (the native recorder's recipe) or the CPU kernel's
_MM_SHAPES = r"must have same reduction dim|shapes cannot be multiplied"


class _MisshapedBackward(torch.autograd.Function):
    """A backward that records an ``mm`` whose shapes do not match (the meta kernel's error)."""

    threads: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        _MisshapedBackward.threads.append(threading.get_ident())
        return (g.view(-1, 1) @ torch.ones(2, 5, device=g.device)).sum(1)


@pytest.mark.parametrize("device_thread", [True, False], ids=["engine_thread", "calling_thread"])
def test_a_shape_error_while_recording_in_backward_raises_naming_the_op(device_thread):
    # on the native recorder, mm is recorded in C++: its recipe's meta kernel raises there
    x = torch.randn(3).to(DEV).requires_grad_()
    before = kiln.metrics.get("backward_errors")
    _MisshapedBackward.threads.clear()
    with (
        torch.autograd.set_multithreading_enabled(device_thread),
        pytest.raises(RuntimeError, match=rf"backward pass failed .*aten.mm.*({_MM_SHAPES})"),
    ):
        _MisshapedBackward.apply(x).sum().backward()
    on_caller = _MisshapedBackward.threads == [threading.get_ident()]
    assert on_caller != device_thread or backward_thread.installed()
    assert isinstance(lazy_tensor.last_backward_error, RuntimeError)
    assert re.search(_MM_SHAPES, str(lazy_tensor.last_backward_error))
    assert kiln.metrics.get("backward_errors") == before + 1
    # the same op outside a backward pass: eager's error, unchanged
    with pytest.raises(RuntimeError, match=_MM_SHAPES) as info:
        torch.ones(3, 1, device=DEV) @ torch.ones(2, 5, device=DEV)
    assert "backward pass failed" not in str(info.value)
    assert kiln.metrics.get("backward_errors") == before + 1
    _device_still_works()
