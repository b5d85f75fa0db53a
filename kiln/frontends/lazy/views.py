"""View ops on lazy tensors: how to read a view from its base, and how to write through it.

A lazy view keeps the chain of view ops that leads from its storage's base value to it.  Reading
replays the chain as graph nodes; writing (``x[:, 0] = y``, ``p.add_(...)`` on a view) walks the
chain back, rebuilding each parent with the inverse rule below, so every alias of the storage sees
the write, as in eager PyTorch.

Multi-output views (split, unbind, chunk) are rewritten at trace time into single-output views
(slice, select) so that each link of a chain has one inverse.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten

# A link of a view chain: (op, args after self, kwargs).
Link = tuple[Any, tuple, tuple]


def _perm_inverse(dims: list[int], ndim: int) -> list[int]:
    dims = [d % ndim for d in dims]
    inv = [0] * ndim
    for i, d in enumerate(dims):
        inv[d] = i
    return inv


def inverse(
    link: Link,
    parent_meta: torch.Tensor,
    record: Callable[..., Any],
    parent: Any,
    value: Any,
) -> Any:
    """New value of the parent after its view ``link`` was overwritten with ``value``.

    ``record(func, *args, **kwargs)`` adds one functional op to the trace and returns its result;
    ``parent`` and ``value`` are lazy values of the parent and of the (new) view.
    """
    func, args, kw = link
    kwargs = dict(kw)
    shape = list(parent_meta.shape)
    name = func._schema.name.split("::")[1]
    # alias(x) = x, detach(x) = x: the write is the new parent
    if name in ("alias", "detach", "lift_fresh", "_alias"):
        return value
    # select(x, d, i) written with v  ->  select_scatter(x, v, d, i)
    if name == "select":
        return record(aten.select_scatter.default, parent, value, *args)
    # slice(x, d, s, e, k) written with v  ->  slice_scatter(x, v, d, s, e, k)
    if name == "slice":
        return record(aten.slice_scatter.default, parent, value, *args, **kwargs)
    # diagonal(x, o, d1, d2) written with v  ->  diagonal_scatter(x, v, o, d1, d2)
    if name == "diagonal":
        return record(aten.diagonal_scatter.default, parent, value, *args, **kwargs)
    # as_strided(x, size, stride, off) written with v  ->  as_strided_scatter(x, v, ...)
    if name == "as_strided":
        return record(aten.as_strided_scatter.default, parent, value, *args, **kwargs)
    # view / reshape / squeeze / unsqueeze / flatten: reshape v back to the parent's shape
    if name in ("view", "_unsafe_view", "reshape", "_reshape_alias", "squeeze", "unsqueeze"):
        return record(aten.view.default, record(aten.clone.default, value), shape)
    # t(x) written with v  ->  t(v)
    if name == "t":
        return record(aten.t.default, value)
    # transpose(x, a, b) written with v  ->  transpose(v, a, b)
    if name == "transpose":
        return record(aten.transpose.int, value, *args)
    # permute(x, p) written with v  ->  permute(v, p^-1)
    if name == "permute":
        return record(aten.permute.default, value, _perm_inverse(list(args[0]), len(shape)))
    raise NotImplementedError(
        f"Kiln lazy device: writing through a view made by {func} is not supported; "
        "make the view a copy first (.clone()) and write the copy back with copy_()"
    )


def split_links(func: Any, args: tuple, kwargs: dict, out_metas: list) -> list[Link]:
    """Single-output view links equivalent to each output of a multi-output view op."""
    name = func._schema.name.split("::")[1]
    if name == "unbind":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [(aten.select.int, (dim, i), ()) for i in range(len(out_metas))]
    if name in ("split", "split_with_sizes", "chunk", "tensor_split"):
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        links = []
        start = 0
        for m in out_metas:
            n = m.shape[dim]
            links.append((aten.slice.Tensor, (dim, start, start + n), ()))  # (step: default)
            start += n
        return links
    raise NotImplementedError(f"Kiln lazy device: multi-output view {func} is not supported")
