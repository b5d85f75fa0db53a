"""``resize_``, ``set_`` and ``out=`` ops that resize, on the kiln device with the native recorder
(docs/native_recorder.md, stage 8): eager's semantics -- shapes, values, and which tensors share
memory afterwards -- checked against the same program run eagerly on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln import metrics
from kiln.frontends.lazy import native

dev = kiln.device()
pytestmark = pytest.mark.usefixtures("native_device")


def both(fn, *inputs):
    """``fn`` on kiln tensors (``kiln.mark_step`` after) and on the CPU: lists of CPU results."""
    got = fn(*[t.to(dev) for t in inputs])
    kiln.mark_step()
    got = [g.cpu() for g in got]
    want = fn(*[t.clone() for t in inputs])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert g.stride() == w.stride()
    return got, want


@pytest.mark.parametrize(
    "size", [(2, 2), (3, 4), (12,), (0,), (1, 1, 5), (2, 0, 3)], ids=lambda s: str(list(s))
)
def test_resize_within_the_storage_matches_eager(size):
    """Shrinking (or the same numel): the tensor keeps its buffer; a view made before the resize
    shares it, and writes through either are seen by both, as in eager."""

    def fn(x):
        x = x * 1  # a value computed in the step (pending at the resize)
        v = x[0]
        r = x.resize_(*size)
        assert r is x
        x.add_(100)
        return [x * 1, v * 1, x.sum().reshape(1)]

    got, want = both(fn, torch.arange(12.0).reshape(3, 4))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_resize_growing_keeps_the_old_elements():
    def fn(x):
        x = x + 0.5
        x.resize_(4, 5)
        return [x.flatten()[:12] * 1, torch.tensor(list(x.shape))]

    got, want = both(fn, torch.arange(12.0).reshape(3, 4))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_resize_of_a_non_contiguous_tensor_and_back_from_zero():
    def fn(x):
        t = x.t()  # a view: the resize makes it contiguous over the same buffer
        t.resize_(2, 3)
        z = x[1] * 1
        z.resize_(0)
        z.resize_(2)
        z.fill_(7)
        return [t * 1, x * 1, z * 1]

    got, want = both(fn, torch.arange(12.0).reshape(3, 4))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_resize_runs_on_the_values_counted_and_the_next_step_computes():
    x = torch.arange(6.0).to(dev) * 2
    kiln.mark_step()
    metrics.reset()
    y = x + 1  # pending at the resize: a forced sync
    x.resize_(2, 2)
    assert metrics.counters()["fallbacks"].get("resize_") == 1
    assert metrics.get("forced_syncs") == 1
    out = (x * 3).sum(0)
    kiln.mark_step()
    torch.testing.assert_close(out.cpu(), torch.tensor([12.0, 24.0]), rtol=0, atol=0)
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) * 2 + 1)


def test_resize_as_matches_eager():
    def fn(x, y):
        x = x * 1
        x.resize_as_(y)
        return [x * 1]

    got, want = both(fn, torch.arange(12.0).reshape(3, 4), torch.ones(2, 5))
    torch.testing.assert_close(got[0].flatten()[:10], want[0].flatten()[:10], rtol=0, atol=0)


def test_set_source_tensor_shares_the_storage_with_no_sync():
    a = torch.arange(5.0).to(dev)
    x = torch.zeros(2, 3).to(dev)
    kiln.mark_step()
    metrics.reset()
    b = a * 2
    r = x.set_(b)
    assert r is x and x.shape == (5,) and native.is_native(x)
    x.add_(1)  # seen by b: one storage
    s = b.sum()
    assert metrics.get("forced_syncs") == 0
    kiln.mark_step()
    want = torch.arange(5.0) * 2 + 1
    torch.testing.assert_close(x.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(b.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(s.cpu(), want.sum(), rtol=0, atol=0)


def test_set_to_a_view_and_set_empty():
    def fn(x, y):
        y = y * 1
        x.set_(y[1:, ::2])
        e = x * 0 + 1
        e.set_()
        return [x * 1, e * 1]

    got, want = both(fn, torch.zeros(2, 2), torch.arange(12.0).reshape(3, 4))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_set_errors_name_the_problem():
    x = torch.zeros(3).to(dev)
    with pytest.raises(RuntimeError, match="Could not set tensor of type"):
        x.set_(torch.zeros(3, dtype=torch.float64).to(dev))
    with pytest.raises(RuntimeError, match="kiln"):
        x.set_(torch.zeros(3))
    assert x.shape == (3,)
    kiln.mark_step()


def test_out_ops_that_resize_their_output_match_eager():
    def fn(a, b, o, p):
        o = o * 1
        torch.add(a, b, out=o)  # from (0,): resized without a warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (eager warns resizing a non-empty out)
            torch.mul(a, 2, out=p)
        return [o * 1, p * 1]

    got, want = both(fn, torch.randn(3, 4), torch.randn(4), torch.empty(0), torch.zeros(5))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_out_ops_that_keep_their_outputs_are_recorded_without_a_sync():
    """``out=`` into a whole tensor or a view, one or two outputs, another dtype: the functional
    op recorded and copied into the output (no forced sync, no fallback), eager's values; a node
    recorded before reads the output's old value."""

    def fn(a, b, x, o, big, i):
        o = o * 1
        big = big * 1
        old = o * 2  # recorded before the write: the old value
        torch.mm(a, b, out=o)
        torch.sum(x, -1, out=big[0, :3])  # into a view: lands in its base
        torch.amax(x, 1, keepdim=True, out=big[1:4, 3:4])
        v = torch.empty(3, device=x.device)
        torch.max(x, 1, out=(v, i))  # two outputs
        f = torch.zeros(2, 3, dtype=torch.float64, device=x.device)
        n = torch.ones(2, 3, dtype=torch.int64, device=x.device)
        torch.add(n, 2, out=f)  # cast into the output
        return [old, o * 1, big * 1, v * 1, i * 1, f * 1]

    inputs = [torch.randn(3, 5), torch.randn(5, 4), torch.randn(3, 6), torch.ones(3, 4)]
    inputs += [torch.zeros(4, 4), torch.zeros(3, dtype=torch.int64)]
    kiln.mark_step()
    metrics.reset()
    got = fn(*[t.to(dev) for t in inputs])
    assert metrics.get("forced_syncs") == 0 and not metrics.counters()["fallbacks"], (
        metrics.counters()["syncs"],
        metrics.counters()["fallbacks"],
    )
    kiln.mark_step()
    want = fn(*[t.clone() for t in inputs])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
