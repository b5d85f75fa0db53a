"""``as_strided`` on the lazy device against eager: values, gradients, and (native recorder) which
calls are recorded as table views instead of running on the values
(kiln/frontends/lazy/native/strided_views.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import on_kiln_device as _run
from _native_testlib import raised

import kiln

# (size, stride) of a (2, 3, 4) value's 24 elements read densely in another order
DENSE = [
    ((2, 3, 4), (12, 4, 1)),  # the same layout
    ((4, 3, 2), (1, 4, 12)),  # every dim reversed
    ((2, 4, 3), (12, 1, 4)),  # the last two swapped
    ((24,), (1,)),
    ((6, 1, 4), (4, 99, 1)),  # a size-1 dim with any stride
    ((2, 12, 1, 1), (12, 1, 12, 12)),  # ATen's channels-last restride of a pooled result
]
# calls the table views cannot express: they keep running on the values
OTHER = [
    ((3, 4), (4, 1), 4),  # an offset
    ((4, 4), (1, 1), 0),  # overlapping
    ((2, 5), (5, 1), 0),  # part of the storage
]


@pytest.mark.parametrize(("size", "stride"), DENSE)
def test_dense_layouts_match_eager_and_are_recorded(
    lazy_recorder: str, size: tuple, stride: tuple
) -> None:
    x = torch.randn(2, 3, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).as_strided(size, stride) + 1

    want = fn(x)
    got, counters = _run(fn, x)
    assert torch.equal(got, want)
    assert counters["fallbacks"] == {}, counters["fallbacks"]
    assert counters["graphs_executed"] == 1


@pytest.mark.parametrize(("size", "stride", "offset"), OTHER)
def test_other_layouts_match_eager(size: tuple, stride: tuple, offset: int) -> None:
    x = torch.randn(16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).as_strided(size, stride, offset) + 1

    got, _ = _run(fn, x)
    assert torch.equal(got, fn(x))


@pytest.mark.parametrize(
    ("x", "size", "stride"),
    [
        (torch.randn(0, 4), (4, 0), (1, 4)),  # no elements
        (torch.randn(4, 6).t(), (4, 6), (6, 1)),  # a transposed source: its storage's order
        (torch.randn(4, 6)[:, ::2], (2, 2), (1, 3)),  # a strided source
    ],
    ids=["size0", "transposed", "strided"],
)
def test_zero_size_and_non_contiguous_sources(x: torch.Tensor, size: tuple, stride: tuple) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.as_strided(size, stride) * 1

    got, _ = _run(fn, x)
    # ``.to(device)`` copies a tensor into a storage of its own, as ``clone`` does (a strided
    # source's copy is dense): ``as_strided`` reads that storage, on any device
    assert torch.equal(got, fn(x.clone()))


def test_out_of_storage_raises_eagers_error() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).as_strided((5, 4), (4, 1))

    assert raised(fn, torch.randn(16).to(kiln.device())) == raised(fn, torch.randn(16))


def test_view_of_a_view_is_not_taken_for_its_storage() -> None:
    """``as_strided`` is relative to the storage, not to the view it is called on."""
    x = torch.randn(4, 6)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y[1:].as_strided((6, 4), (1, 6), 0) + 0  # from the storage's start

    got, _ = _run(fn, x)
    assert torch.equal(got, fn(x))


def test_in_place_restride_matches_eager() -> None:
    x = torch.randn(2, 5, 1, 1)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        y.as_strided_((2, 5, 1, 1), (5, 1, 5, 5))
        return y * 3

    want = fn(x)
    got, counters = _run(fn, x)
    assert torch.equal(got, want)
    assert counters["fallbacks"] == {}, counters["fallbacks"]


def test_pooling_a_transposed_sequence_forward_and_backward(lazy_recorder: str) -> None:
    """Swin's pooler: ``adaptive_avg_pool1d`` of a (B, L, C) sequence transposed to (B, C, L):
    ATen restrides the mean with ``as_strided_``, its backward goes through ``as_strided`` views
    of zeros.  One graph, no fallback, eager's values and gradient."""
    x = torch.randn(3, 7, 5)
    w = torch.randn(5)

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        y = F.adaptive_avg_pool1d(x.transpose(1, 2), 1).flatten(1)
        (y * w).sum().backward()
        return torch.cat([y.detach().flatten(), x.grad.flatten()])

    want = step(x, w)
    got, counters = _run(step, x, w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert counters["fallbacks"] == {}, counters["fallbacks"]
    assert counters["graphs_executed"] == 1
