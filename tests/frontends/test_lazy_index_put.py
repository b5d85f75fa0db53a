"""``_index_put_impl_`` on the lazy device: recorded (as ``index_put_``), not run on ATen.

Advanced indexing's backward (the gradient of ``w[idx]``: an accumulating write into zeros) and
``Tensor.__setitem__`` with index tensors call ``_index_put_impl_``; the lazy device ran it as a
counted ATen fallback (Swin's relative position bias table, Whisper's decoder positions), a sync
in the middle of the step.  Both recorders now record it as ``index_put_`` (the same write;
``unsafe`` only lets ATen skip bounds checks, which the recorded op keeps)."""

from __future__ import annotations

import pytest
import torch
from _native_testlib import on_kiln_device as _on_device
from _native_testlib import raised

import kiln

aten = torch.ops.aten


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("unsafe", [True, False])
def test_index_put_impl_matches_eager_without_fallback(accumulate: bool, unsafe: bool) -> None:
    x = torch.randn(6, 3)
    idx = torch.tensor([0, 2, 2, 5, -1])  # repeated and negative indices
    v = torch.randn(5, 3)

    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten._index_put_impl_(x, (i,), v, accumulate, unsafe)

    want = fn(x.clone(), idx, v)
    got, counters = _on_device(fn, x, idx, v)
    if accumulate:  # the sums over repeated indices, in eager's order or another
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # without accumulate a repeated index keeps one of its writes (which one is unspecified)
        keep = torch.ones(6, dtype=torch.bool)
        keep[2] = False
        assert torch.equal(got[keep], want[keep])
    assert counters["fallbacks"] == {}, counters["fallbacks"]
    assert counters["graphs_executed"] >= 1


def test_indexing_gradient_matches_eager_without_fallback() -> None:
    table = torch.randn(7, 4)
    idx = torch.tensor([[1, 3], [3, 6], [0, 1]])
    scale = torch.randn(3, 2, 4)

    def grad(table: torch.Tensor, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        w = table.clone().requires_grad_()
        (w[idx] * scale).sum().backward()
        return w.grad

    want = grad(table, idx, scale)
    got, counters = _on_device(grad, table, idx, scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counters["fallbacks"] == {}, counters["fallbacks"]


def test_zero_size_and_non_contiguous_operands() -> None:
    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten._index_put_impl_(x, (i,), v, True, True)

    cases = [
        (torch.randn(6, 3), torch.tensor([], dtype=torch.long), torch.randn(0, 3)),  # no index
        (torch.randn(6, 0), torch.tensor([1, 4]), torch.randn(2, 0)),  # no columns
        # a transposed destination and strided values
        (torch.randn(3, 6).t(), torch.tensor([5, 0, 5]), torch.randn(3, 6)[:, ::2]),
    ]
    for x, idx, v in cases:
        want = fn(x.clone(), idx, v)
        got, counters = _on_device(fn, x, idx, v)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert counters["fallbacks"] == {}, counters["fallbacks"]


@pytest.mark.parametrize(
    ("idx", "values"),
    [
        (torch.tensor([0, 12]), torch.ones(2, 3)),  # an index out of range
        (torch.tensor([0, 1]), torch.ones(3, 3)),  # values of the wrong shape
    ],
    ids=["out_of_bounds", "shape_mismatch"],
)
def test_bad_arguments_raise_eagers_error(idx: torch.Tensor, values: torch.Tensor) -> None:
    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten._index_put_impl_(x, (i,), v, True, True)

    dev = kiln.device()
    want = raised(fn, torch.zeros(6, 3), idx, values)
    assert raised(fn, torch.zeros(6, 3).to(dev), idx.to(dev), values.to(dev)) == want
