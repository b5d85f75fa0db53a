"""``kiln::matmul_strided``: a batched matrix product that reads its operands through their strides.

    matmul_strided(Tensor a, Tensor b, int[]? order=None) -> Tensor

The values are ``torch.matmul(a, b)`` for ``a`` of shape ``[*batch, M, K]`` and ``b`` of shape
``[*batch, K, N]`` with the *same* batch dims (no broadcasting), rank 3 or more.  The result is
dense, its dims laid out outermost first in ``order`` (a permutation of all dims that keeps the
last dim last; None: row-major contiguous).

Why: ``torch.matmul`` of rank-4 operands runs as ``bmm`` over the batch dims merged into one, so
an operand whose batch dims cannot merge (attention's heads, ``view(B, T, H, E).transpose(1, 2)``
of a projection's output) is first copied whole, and so is a result the model transposes back
(``y.transpose(1, 2).reshape(B, T, H * E)``).  This op's C++ kernel (the native graph launcher
registers it for CPU: ``kiln/codegen/cpp/launcher.cpp``) hands MKL one GEMM per batch element with
its own pointers and leading dims, so neither copy is made; with ``order`` the result is written in
the layout its reader wants.  Its gradients are products of the same op (reading the incoming
gradient through its strides) written in the layout of the operand they belong to, so a
gradient's reshape back to ``(B, T, H * E)`` is a view too.

Everything about the op is here, beside its record (:func:`kiln.ir.ops.defop`): the schema, the
reference kernel (``CompositeExplicitAutograd``: ``torch.matmul`` and a copy into the layout; what
runs where the launcher is not built), the shape rule (``register_fake``) and the autograd formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

NAME = "kiln::matmul_strided"

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("matmul_strided(Tensor a, Tensor b, int[]? order=None) -> Tensor")


def out_shape(a: torch.Tensor, b: torch.Tensor) -> list:
    """The result's shape; ValueError for operands the op does not take (the C++ kernel raises
    the same messages)."""
    if a.dim() < 3 or a.dim() != b.dim():
        raise ValueError(
            f"matmul_strided takes two operands of the same rank >= 3, got {a.dim()} and {b.dim()}"
        )
    if a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"matmul_strided: batch dims differ: {list(a.shape)} @ {list(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul_strided: {list(a.shape)} @ {list(b.shape)}: inner dims differ")
    if a.dtype != b.dtype:
        raise ValueError("matmul_strided: the operands' dtypes differ; convert one to the other's")
    return [*a.shape[:-1], b.shape[-1]]


def valid_order(order: Sequence[int] | None, rank: int) -> list[int]:
    """``order`` checked (a permutation of ``range(rank)`` ending in the last dim), or the
    row-major order for None."""
    if order is None:
        return list(range(rank))
    o = [int(d) for d in order]
    if sorted(o) != list(range(rank)) or o[-1] != rank - 1:
        raise ValueError(
            f"matmul_strided: order {o} is not a permutation of the operands' dims ending in the "
            "last"
        )
    return o


def _reference(
    a: torch.Tensor, b: torch.Tensor, order: Sequence[int] | None = None
) -> torch.Tensor:
    shape = out_shape(a, b)
    out = torch.empty_permuted(shape, valid_order(order, a.dim()), dtype=a.dtype, device=a.device)
    return out.copy_(torch.matmul(a, b))


def _fake(a: torch.Tensor, b: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    shape = out_shape(a, b)
    return torch.empty_permuted(shape, valid_order(order, a.dim()), dtype=a.dtype, device=a.device)


_LIB.impl("matmul_strided", _reference, "CompositeExplicitAutograd")
torch.library.register_fake(NAME, _fake, lib=_LIB)

OP = torch.ops.kiln.matmul_strided.default


def layout_of(x: torch.Tensor) -> list[int] | None:
    """The order (outermost first) in which ``x``'s dims lie in memory, if its last dim is
    innermost with stride 1 and no two elements overlap (a permuted view of a contiguous tensor,
    or a slice of one such as attention's q out of a fused q/k/v projection); None otherwise."""
    n = x.dim()
    if n < 3 or (x.stride(-1) != 1 and x.size(-1) != 1):
        return None
    order = sorted(range(n), key=lambda d: (-x.stride(d), d))
    if order[-1] != n - 1:
        return None
    extent = 1  # elements spanned by the dims inside the current one
    for d in reversed(order):
        if x.size(d) == 1:
            continue
        if x.stride(d) < extent:
            return None  # overlapping (or broadcast: stride 0)
        extent = x.stride(d) * x.size(d)
    return order


def product(x: torch.Tensor, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x @ y`` laid out as ``like`` is: in its order where ``like`` is dense with the last dim
    innermost; computed transposed (``(y^T @ x^T)^T``) where ``like`` is dense with the second
    last dim innermost (a transposed view); row-major otherwise."""
    o = layout_of(like)
    if o is not None:
        return OP(x, y, o)
    ot = layout_of(like.transpose(-2, -1))
    if ot is not None:
        return OP(y.transpose(-2, -1), x.transpose(-2, -1), ot).transpose(-2, -1)
    return OP(x, y)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, _ = inputs
    ctx.save_for_backward(a, b)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    ga = product(grad, b.transpose(-2, -1), a) if ctx.needs_input_grad[0] else None
    gb = product(a.transpose(-2, -1), grad, b) if ctx.needs_input_grad[1] else None
    return ga, gb, None


torch.library.register_autograd(NAME, _backward, setup_context=_setup_context, lib=_LIB)
