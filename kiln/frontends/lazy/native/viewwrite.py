"""Stage 3 of the native recorder: an in-place write to a *view* of a native tensor, recorded as
functional + write-back through the view chain, as the Python recorder's ``tensor._write`` does.

Needs: the write's new value for the view, already recorded (a native tensor of the view's shape
and dtype), and the view's chain of C++ view recipes (``view_chain``).  Guarantees: the storage's
base takes, as its pending value, the old base with the view's elements replaced -- rebuilt link
by link from the view back to the base with the inverse rules of :mod:`kiln.frontends.lazy.views`
(``select_scatter``, ``slice_scatter``, ``diagonal_scatter``, a reshape, transpose or permute of
the value) -- so every tensor on the storage (the base, its aliases, other views) sees the write,
with no forced sync.  Nothing is written (False) for a storage shared with a view made on the
values (aliased / lent), a link with no inverse (``expand``, ``unfold``) or a rebuilt value whose
geometry the base cannot take; the caller then runs the op on the values, as before.  Nodes
recorded for a write given up are dead: the cut prunes them.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.frontends.lazy.native import convert
from kiln.frontends.lazy.views import Link, inverse
from kiln.ir.graph import In

aten = torch.ops.aten

# view links the inverse rules take (Kiln op names: lowering.aten.op_name)
_INVERTIBLE = frozenset(
    (
        "view.default",
        "transpose.int",
        "t.default",
        "permute.default",
        "unsqueeze.default",
        "squeeze.dim",
        "squeeze.dims",
        "select.int",
        "slice.Tensor",
        "diagonal.default",
    )
)

_links: dict[int, Link | None] = {}


def _link(mod: Any, rid: int) -> Link | None:
    """The view recipe ``rid`` as ``(op, args after self, kwargs)``; None when not invertible."""
    if rid in _links:
        return _links[rid]
    t = convert.template(mod, rid)
    link: Link | None = None
    if t.op in _INVERTIBLE and t.args and t.args[0] == In(0) and t.fallback is None:
        packet, overload = t.op.split(".")
        func = getattr(getattr(aten, packet), overload)
        link = (func, tuple(t.args[1:]), tuple(t.kwargs))
    _links[rid] = link
    return link


def _call(func: Any, *args: Any, **kwargs: Any) -> Any:
    return func(*args, **kwargs)  # on native tensors: recorded (a node, or a view link)


def chain_of(mod: Any, target: torch.Tensor) -> tuple[torch.Tensor, list[Link]] | None:
    """The base tensor of ``target``'s storage and the invertible links from it to ``target``, or
    None when a write through them cannot be recorded (see the module docstring)."""
    got = mod.view_chain(target)
    if got is None:
        return None
    base, rids = got
    links: list[Link] = []
    for rid in rids:
        link = _link(mod, rid)
        if link is None:
            return None
        links.append(link)
    return base, links


def write_through(mod: Any, base: torch.Tensor, links: list[Link], value: torch.Tensor) -> bool:
    """The storage of ``base`` takes ``base`` with the view ``links`` lead to replaced by
    ``value``; False (nothing written) when the rebuilt value's geometry is not the base's."""
    parents = [base]
    for func, args, kwargs in links[:-1]:  # each link's parent, as a view (no node)
        parents.append(func(parents[-1], *args, **dict(kwargs)))
    new = value
    for link, parent in zip(reversed(links), reversed(parents)):
        new = inverse(link, parent, _call, parent, new)
    if new.dtype != base.dtype:
        new = new.to(base.dtype)
    if mod.geo_of(new) != mod.geo_of(base):
        new = aten.clone.default(new, memory_format=torch.contiguous_format)
    return bool(mod.write_back(base, new))
