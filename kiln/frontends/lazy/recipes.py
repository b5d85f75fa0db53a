"""The fast path of recording one op on lazy tensors: recipes cached by call signature.

Recording an op the general way (``tensor._record``) runs its meta kernel for the output
geometry, walks its arguments into a node template and looks up the Kiln op it lowers to: tens of
microseconds of Python per op.  A training loop records the same ops on the same geometries every
step, so all of that is worked out once per *call signature* and kept as a :class:`Recipe`: the
node's op, argument template and output types, the output metas, and which arguments become node
inputs.  Replaying a recipe costs a signature, a dictionary lookup and the new node.

The signature of a call is the op, the default dtype and the arguments, every lazy tensor
replaced by its geometry (an interned :class:`Geo`: shape, strides, offset, dtype) and every
lifted Python float by a marker (its value is a graph input, not part of the graph).  Ints,
bools, strings, None, dtypes, devices and (nested) lists of these are part of it as they are.  A
call with anything else (a CPU tensor, a generator, a symbolic size) has no signature and takes
the general path, as do random ops, in-place ops and ops with a decomposition (``tensor._dispatch``
decides).  View ops have view recipes (:class:`ViewRecipe`): the output meta and an interned chain
:class:`Link` whose node template ``tensor.read`` replays.

Each recipe also has a token (an int, never reused): the trace keys the nodes it records by
``(token, inputs)``, so a repeated step is recognised by comparing small tuples instead of
hashing every node (``trace.Trace.keys``).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from kiln.ir.graph import Node, TensorType

# Markers in signatures: objects compared by identity, so they equal no argument value.
_FLOAT = object()  # a lifted Python float
_TRUE = object()
_FALSE = object()
_OPEN = object()  # a list or tuple starts / ends
_CLOSE = object()
_KWARGS = object()  # keyword arguments follow
_HASHABLE_ATOMS = (torch.dtype, torch.device, torch.memory_format, torch.layout)
_default_dtype = torch.get_default_dtype

_MAX = 65536  # recipes and geometries kept; when full, both start over (new identities)


class Geo:
    """One interned geometry of a lazy tensor; compared by identity."""

    __slots__ = ("shape", "stride", "offset", "dtype")

    def __init__(self, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype) -> None:
        self.shape = shape
        self.stride = stride
        self.offset = offset
        self.dtype = dtype


_geos: dict[tuple, Geo] = {}


def geo_of(meta: torch.Tensor) -> Geo:
    k = (tuple(meta.shape), meta.stride(), meta.storage_offset(), meta.dtype)
    g = _geos.get(k)
    if g is None:
        if len(_geos) >= _MAX:
            clear()
        g = _geos[k] = Geo(*k)
    return g


class Recipe:
    """Everything needed to record one call signature again (see the module docstring)."""

    __slots__ = (
        "op",
        "args",
        "kwargs",
        "types",
        "fallback",
        "single",
        "meta",
        "geo",
        "outs",
        "token",
    )

    def __init__(
        self,
        node: Node,
        fallback: str | None,
        outs: list[tuple[torch.Tensor, Geo]] | None,
        out_meta: torch.Tensor,
    ) -> None:
        self.op = node.op
        self.args = node.args
        self.kwargs = node.kwargs
        self.types: tuple[TensorType | None, ...] = node.types
        self.fallback = fallback  # op name counted as a fallback each time (opaque node)
        # one tensor output (meta, geo), or a tuple of them (outs: (meta, geo) per item)
        self.single = outs is None
        self.meta = out_meta if outs is None else None
        self.geo = geo_of(out_meta) if outs is None else None
        self.outs = outs
        self.token = next(_tokens)


_tokens = itertools.count()
_recipes: dict[tuple, Any] = {}  # Recipe or ViewRecipe
lazy_type: type = type(None)  # set by kiln.frontends.lazy.tensor to LazyTensor


def clear() -> None:
    _recipes.clear()
    _geos.clear()
    _links.clear()


def signature(op: Any, args: tuple, kwargs: dict, lift: bool, leaves: list) -> tuple | None:
    """The call's signature (``op``: one object per ATen overload, hashed by identity), or None
    when it has none; appends to ``leaves`` the arguments that
    become node inputs (lazy tensors and lifted floats), in the order the node template takes
    them (depth first, positional then keyword)."""
    # the default dtype decides the dtype of factories and of int tensors with float scalars
    parts: list = [op, _default_dtype()]
    for a in args:  # the common arguments inline, the rest in _part
        t = type(a)
        if t is lazy_type:
            g = a._g
            if g is None:
                g = a._g = geo_of(a._meta)
            parts.append(g)
            leaves.append(a)
        elif t is int:
            parts.append(a)
        elif not _part(a, lift, parts, leaves):
            return None
    if kwargs:
        parts.append(_KWARGS)
        for k, v in kwargs.items():
            parts.append(k)
            if not _part(v, lift, parts, leaves):
                return None
    return tuple(parts)


def _part(a: Any, lift: bool, parts: list, leaves: list) -> bool:
    t = type(a)
    if t is lazy_type:
        g = a._g
        if g is None:
            g = a._g = geo_of(a._meta)
        parts.append(g)
        leaves.append(a)
    elif t is int or a is None or t is str:
        parts.append(a)
    elif t is float:
        if lift:
            parts.append(_FLOAT)
            leaves.append(a)
        else:
            parts.append(_FLOAT)
            parts.append(a)
    elif t is bool:
        parts.append(_TRUE if a else _FALSE)
    elif t is list or t is tuple or t is torch.Size:
        parts.append(_OPEN)
        for x in a:
            if not _part(x, lift, parts, leaves):
                return False
        parts.append(_CLOSE)
    elif isinstance(a, _HASHABLE_ATOMS):
        parts.append(a)
    else:
        return False
    return True


def lookup(key: tuple) -> Any:
    return _recipes.get(key)


def remember(key: tuple, node: Node, fallback: str | None, out_meta: Any, n_leaves: int) -> None:
    """Keep the recipe of a call just recorded the general way, if it can be replayed: one tensor
    output or a tuple of tensors, and one node input per leaf."""
    if len(node.inputs) != n_leaves:
        return
    if isinstance(out_meta, torch.Tensor):
        outs = None
    elif type(out_meta) is tuple and all(isinstance(m, torch.Tensor) for m in out_meta):
        outs = [(m, geo_of(m)) for m in out_meta]
    else:
        return
    if len(_recipes) >= _MAX:
        clear()
    _recipes[key] = Recipe(node, fallback, outs, out_meta)


class Link:
    """One interned link of a view chain (``(op, args after self, kwargs)``, as ``views.Link``)
    made by a view recipe, with how to record it: the node template of the view applied to the
    geometry it was made on, and its output meta."""

    __slots__ = ("args", "fallback", "kwargs", "link", "meta", "op", "token", "types")

    def __init__(self, link: tuple, meta: torch.Tensor, node: Node, fallback: str | None) -> None:
        self.link = link
        self.meta = meta
        self.op = node.op
        self.args = node.args
        self.kwargs = node.kwargs
        self.types = node.types
        self.fallback = fallback
        self.token = next(_tokens)


class ViewRecipe:
    """A view call: per output, its meta, geometry and interned chain link."""

    __slots__ = ("outs", "single")

    def __init__(self, outs: list[tuple[torch.Tensor, Geo, tuple]], single: bool) -> None:
        self.outs = outs
        self.single = single


_links: dict[int, Link] = {}  # by id of the link tuple (kept alive by the entry itself)


def link_info(link: tuple) -> Link | None:
    return _links.get(id(link))


def remember_view(
    key: tuple, outs: list[tuple[torch.Tensor, tuple, Node, str | None]], single: bool
) -> ViewRecipe:
    """Keep a view call's recipe: ``outs`` holds, per output, its meta, its chain link, the link's
    node (input ``In(0)`` = the viewed value) and the op counted as a fallback, if any."""
    if len(_recipes) >= _MAX:
        clear()
    items = []
    for meta, link, node, fallback in outs:
        _links[id(link)] = Link(link, meta, node, fallback)
        items.append((meta, geo_of(meta), link))
    r = _recipes[key] = ViewRecipe(items, single)  # type: ignore[assignment]
    return r
