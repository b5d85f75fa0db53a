"""Strided layouts: which ones are dense (every element of a span of memory exactly once)."""

from __future__ import annotations

from collections.abc import Sequence


def dense_order(size: Sequence[int], stride: Sequence[int]) -> list[int] | None:
    """The dims whose size is not 1, outermost (largest stride) first, where ``size`` / ``stride``
    is a dense, non-overlapping layout (each such dim's stride is the product of the sizes of the
    dims inside it: some order of the dims is contiguous); None otherwise."""
    order = sorted((i for i, n in enumerate(size) if n != 1), key=lambda i: -stride[i])
    want = 1
    for i in reversed(order):
        if stride[i] != want:
            return None
        want *= size[i]
    return order
