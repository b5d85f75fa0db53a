"""Matrix products over several batch dims -> ``kiln::matmul_strided``, on Dynamo's graph.

A model that writes attention out (nanoGPT: ``q @ k.transpose(-2, -1)``, ``att @ v``, with
``q = x.view(B, T, H, E).transpose(1, 2)``) multiplies rank-4 tensors whose batch dims (B, H) do
not merge into one, so ``torch.matmul`` copies each operand whole before its ``bmm``, copies the
saved operands again in the backward, and the model copies the result back with
``y.transpose(1, 2).contiguous()``.  ``kiln::matmul_strided`` (:mod:`kiln.ir.matmul_strided`)
reads the operands through their strides and writes its result in the layout its reader wants::

    %s = matmul(%q, %kt)                      # q, kt: f32[B, H, T, E], f32[B, H, E, T]
    %y = matmul(%p, %v)
    %u = transpose(%y, 1, 2)
  becomes
    %s = kiln.matmul_strided(%q, %kt, None)
    %y = kiln.matmul_strided(%p, %v, [0, 2, 1, 3])   # dense as (B, T, H, E): %u is contiguous
    %u = transpose(%y, 1, 2)

(``order`` is set where the product's only reader is a ``transpose`` or ``permute`` that keeps
the last dim last.)  The op's gradients are the same op, written in each operand's layout, so the
backward copies nothing either.  Measured at gpt-large's attention (B=8, H=4, T=128, E=64, 2
threads, per call): ``q @ k^T`` 499 -> 410 us, ``(p @ v).transpose(1, 2).reshape(B, T, C)`` 416 ->
389 us; the results are bit-equal there (the same MKL GEMMs).

Matched: ``operator.matmul``, ``torch.matmul`` and ``Tensor.matmul`` of two float32 tensors of the
same rank >= 4 with the same static batch sizes, outside autocast (which would pick another dtype
per op).  Everything else stays as written.

Needs: a Dynamo FX graph with ``example_value`` metadata.  Guarantees: ``torch.matmul``'s values
(the same GEMMs, per batch element); the node's metadata recomputed for the new op; off with
``KILN_DISABLE_PASSES=strided_matmul``; each rewritten call counted as ``strided_matmuls``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from kiln import metrics
from kiln.frontends.compile.attention import _val, uses_autocast
from kiln.frontends.compile.rewrite_done import example_values, finish
from kiln.ir.matmul_strided import OP

_MATMUL = (operator.matmul, torch.matmul)
_TRANSPOSE = (torch.transpose,)
_PERMUTE = (torch.permute,)


def _is_matmul(n: torch.fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in _MATMUL
    return n.op == "call_method" and n.target == "matmul"


def _operands(n: torch.fx.Node) -> tuple[Any, Any] | None:
    if len(n.args) != 2 or n.kwargs:
        return None
    return n.args[0], n.args[1]


def _takes(a: Any, b: Any) -> bool:
    """Two float32 tensors of the same rank >= 4, the same static batch sizes."""
    if not all(isinstance(x, torch.Tensor) for x in (a, b)):
        return False
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.dim() < 4 or b.dim() != a.dim():
        return False
    if a.layout != torch.strided or b.layout != torch.strided:
        return False
    if not all(isinstance(s, int) for s in (*a.shape, *b.shape)):
        return False
    return a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]


def _dim(d: Any, rank: int) -> int | None:
    if not isinstance(d, int) or not -rank <= d < rank:
        return None
    return d % rank


def _reader_order(n: torch.fx.Node, rank: int) -> list[int] | None:
    """The permutation applied by ``n``'s only reader, if it is a ``transpose``/``permute`` that
    keeps the last dim last and is not the identity."""
    users = list(n.users)
    if len(users) != 1:
        return None
    u = users[0]
    if not u.args or u.args[0] is not n or u.kwargs:
        return None
    fn = u.target if u.op in ("call_function", "call_method") else None
    p: list[int] | None = None
    if fn in _TRANSPOSE or fn == "transpose":
        if len(u.args) != 3:
            return None
        d0, d1 = _dim(u.args[1], rank), _dim(u.args[2], rank)
        if d0 is None or d1 is None:
            return None
        p = list(range(rank))
        p[d0], p[d1] = p[d1], p[d0]
    elif fn in _PERMUTE or fn == "permute":
        dims = u.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = tuple(dims[0])
        if len(dims) != rank:
            return None
        p = [_dim(d, rank) for d in dims]  # type: ignore[misc]
        if None in p or sorted(p) != list(range(rank)):  # type: ignore[type-var]
            return None
    if p is None or p[-1] != rank - 1 or p == list(range(rank)):
        return None
    return p


def strided_matmuls(gm: torch.fx.GraphModule) -> int:
    """Rewrite every matched product of ``gm`` in place; returns how many."""
    g = gm.graph
    if uses_autocast(g):
        return 0
    found = 0
    for n in list(g.nodes):
        if not _is_matmul(n):
            continue
        ops = _operands(n)
        if ops is None:
            continue
        a, b = (_val(x) for x in ops)
        if not _takes(a, b):
            continue
        order = _reader_order(n, a.dim())
        args = (ops[0], ops[1], order)
        fake_mode = getattr(a, "fake_mode", None)
        try:
            with example_values(fake_mode):
                example = OP(a, b, order)
        except Exception as e:  # noqa: BLE001 - the product stays torch.matmul
            metrics.fallback(f"strided_matmul ({type(e).__name__}: {e})")
            continue
        n.op, n.target, n.args, n.kwargs = "call_function", OP, args, {}
        n.meta["example_value"] = example
        found += 1
    return finish(gm, found, "strided_matmuls")


__all__ = ["strided_matmuls"]
