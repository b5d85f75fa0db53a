"""Shape-generic lazy graphs: a step whose only change is a dimension size reuses one graph.

Compile mode gets this from Dynamo's automatic dynamic shapes: the first graph is compiled with
static sizes; when a size changes, the frame is compiled once more with the changed dimensions
symbolic, and that graph serves every later size.  PyTorch/XLA compiles one graph per shape.
Here the lazy device does what Dynamo does, on its cut graphs:

* Every cut graph is split into a *skeleton* (the graph with every int in its types and
  arguments replaced by a marker) and the list of those ints, in a fixed order (:func:`split`).
  Graphs with equal skeletons form a *family*: the same step at different sizes.
* The first graph of a family compiles as it is (static).  On the second, different member the
  two int lists are compared (:func:`generalize`): equal ints stay constants; each differing one
  becomes a symbol (a differing dimension of a graph input, or a new size such as a factory's)
  or an expression of symbols (``2*s0`` = batch x length, ``s0*s1``, ``s0 - 1``).  A differing
  int may be symbolic only where the op's schema takes a ``SymInt`` (view and expand sizes,
  slice bounds, factory sizes; ``arange``'s end), never where it takes an ``int`` (a dim index).
  The generic graph has the form compile mode gives the same step: symbols are ``int`` scalar
  inputs after the graph's own, expressions are ``pyop`` nodes, sizes in types are the
  expressions' text, sizes in arguments are ``In`` markers.  It compiles once; kernels read
  their sizes at run time.
* Every later member is checked against the family's template (:func:`Template.bind`): its ints
  must be exactly the template's, evaluated at the symbol values read from the graph itself.
  Then the generic graph, run with those values, is that very graph; otherwise the member
  compiles on its own, as before.  Symbols are never 0 or 1 (Dynamo specializes those sizes
  too): a size 0 or 1 gets its own graph.

The decision is made once per cut graph (``trace._Entry`` caches it), so a steady step pays
nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from kiln import metrics
from kiln.config import config
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.semantics import resolve
from kiln.runtime.compiler import compile_graph

_INT = "<int>"  # marks an int in a skeleton (a str: no int or bool equals it)
_MAX_FAMILIES = 64
_MIN_SIZE = 2  # symbols and symbolic sizes are never 0 or 1 (those get their own graph)

# An expression of symbols: coef * prod(symbols) + add, symbols as sorted ids.
Expr = tuple[int, tuple[int, ...], int]


def text(e: Expr) -> str:
    """The expression as a shape string (``"2*s0"``, ``"s0*s1"``, ``"s0 - 1"``)."""
    c, syms, add = e
    parts = ([str(c)] if c != 1 else []) + [f"s{s}" for s in syms]
    t = "*".join(parts)
    if add:
        t += f" + {add}" if add > 0 else f" - {-add}"
    return t


def evaluate(e: Expr, values: list[int]) -> int:
    c, syms, add = e
    v = c
    for s in syms:
        v *= values[s]
    return v + add


# ---- splitting a graph into skeleton and ints --------------------------------------------------
@lru_cache(maxsize=4096)
def _sized_args(op: str) -> tuple[tuple[bool, ...], dict[str, bool]] | None:
    """Per argument of a node's ATen op (positional, and by name): may an int there be a symbolic
    size?  Yes where the schema takes a ``SymInt`` (``SymInt[]``, ``SymInt?``), and for
    ``arange``'s ``Scalar`` bounds; no where it takes an ``int`` (a dim index).  None for Kiln's
    own ops (input, getitem, pyop, ...): none of their ints is a size."""
    try:
        fn = resolve(op)
    except (AttributeError, KeyError, ValueError, RuntimeError):
        return None
    schema = getattr(fn, "_schema", None)
    if schema is None:
        return None
    sized = tuple(_size_type(a.real_type, op) for a in schema.arguments)
    return sized, {a.name: z for a, z in zip(schema.arguments, sized)}


def _size_type(t: Any, op: str) -> bool:
    while isinstance(t, (torch.OptionalType, torch.ListType)):
        t = t.getElementType()
    if isinstance(t, torch.SymIntType):
        return True
    return isinstance(t, torch.NumberType) and op.startswith("arange.")


@dataclass
class Split:
    skeleton: tuple  # hashable; equal for graphs that differ only in ints
    ints: list[int]  # every int of types and arguments, in a fixed order
    sized: list[bool]  # per int: may it be symbolic (a size in a type or a SymInt argument)
    inputs: set[int]  # positions in ``ints`` of the dims of graph inputs


def _walk(x: Any, sized: bool, ints: list[int], ok: list[bool]) -> Any:
    if type(x) is int:
        ints.append(x)
        ok.append(sized)
        return _INT
    if isinstance(x, (tuple, list)):
        return (type(x).__name__,) + tuple(_walk(y, sized, ints, ok) for y in x)
    return x


def split(g: Graph) -> Split:
    """The graph's skeleton and its ints (see the module docstring)."""
    ints: list[int] = []
    ok: list[bool] = []
    from_inputs: set[int] = set()
    skel: list[Any] = []
    for n in g.nodes:
        schema = _sized_args(n.op)
        pos, named = schema if schema is not None else ((), {})
        args = tuple(_walk(a, k < len(pos) and pos[k], ints, ok) for k, a in enumerate(n.args))
        kwargs = tuple((k, _walk(v, named.get(k, False), ints, ok)) for k, v in n.kwargs)
        types = []
        for t in n.types:
            if t is None:
                types.append(None)
                continue
            if n.op == "input":
                from_inputs.update(range(len(ints), len(ints) + len(t.shape)))
            shape = _walk(tuple(t.shape), True, ints, ok)
            types.append((shape, t.dtype, t.py))
        skel.append((n.op, n.inputs, args, kwargs, tuple(types)))
    return Split((tuple(skel), g.outputs), ints, ok, from_inputs)


# ---- generalizing two members of a family --------------------------------------------------------
@dataclass
class Template:
    """What the generic graph was made from: per int of the skeleton, a constant (None) or an
    expression, and where each symbol's value is read (its first int)."""

    exprs: list[Expr | None]
    static: list[int]
    first: list[int]  # per symbol: position in ``ints`` where its value is read

    def bind(self, s: Split) -> list[int] | None:
        """The symbol values under which the template is exactly ``s``'s graph, or None."""
        ints = s.ints
        values = [ints[p] for p in self.first]
        if any(v < _MIN_SIZE for v in values):
            return None
        for p, e in enumerate(self.exprs):
            if e is None:
                if ints[p] != self.static[p]:
                    return None
            else:
                v = ints[p]
                if v < _MIN_SIZE or v != evaluate(e, values):
                    return None
        return values


def _express(a: int, b: int, syms: list[tuple[int, int]]) -> Expr | None:
    """An expression of the known symbols that is ``a`` in the first graph and ``b`` in the
    second (tried in order: a symbol, c*s, s*t, c*s*t, s + c)."""
    for i, (sa, sb) in enumerate(syms):
        if (sa, sb) == (a, b):
            return (1, (i,), 0)
    for i, (sa, sb) in enumerate(syms):
        if a % sa == 0 and b % sb == 0 and a // sa == b // sb:
            return (a // sa, (i,), 0)
    for i, (sa, sb) in enumerate(syms):
        for j in range(i, len(syms)):
            ta, tb = sa * syms[j][0], sb * syms[j][1]
            if a % ta == 0 and b % tb == 0 and a // ta == b // tb:
                return (a // ta, (i, j), 0)
    for i, (sa, sb) in enumerate(syms):
        if a - sa == b - sb:
            return (1, (i,), a - sa)
    return None


def generalize(a: Split, b: Split) -> Template | None:
    """The template under which both graphs are instances, or None when some int differs in a
    way that cannot be a size (a dim index, a flag, a size of 0 or 1, no expression fits)."""
    if a.skeleton != b.skeleton or len(a.ints) != len(b.ints):
        return None
    syms: list[tuple[int, int]] = []  # per symbol: its value in a and in b
    first: list[int] = []
    exprs: list[Expr | None] = [None] * len(a.ints)

    def new_symbol(p: int, x: int, y: int) -> Expr:
        for i, pair in enumerate(syms):
            if pair == (x, y):
                return (1, (i,), 0)
        syms.append((x, y))
        first.append(p)
        return (1, (len(syms) - 1,), 0)

    order = sorted(range(len(a.ints)), key=lambda p: p not in a.inputs)  # input dims first
    for p in order:
        x, y = a.ints[p], b.ints[p]
        if x == y:
            continue
        if not a.sized[p] or min(x, y) < _MIN_SIZE:
            return None
        if p in a.inputs:
            exprs[p] = new_symbol(p, x, y)
        else:
            exprs[p] = _express(x, y, syms) or new_symbol(p, x, y)
    if not syms:
        return None
    return Template(exprs, list(a.ints), first)


# ---- building the generic graph ----------------------------------------------------------------
def build(g: Graph, t: Template) -> Graph:
    """``g`` with every symbolic int replaced: shapes by the expression's text, arguments by an
    ``In`` marker to an ``int`` node (a scalar input per symbol, a ``pyop`` per expression)."""
    n_in = max((n.kwarg("index") for n in g.nodes if n.op in ("input", "scalar")), default=-1) + 1
    pre: list[Node] = []
    ids: dict[Expr, int] = {}
    int_t = (TensorType((), None, "int"),)

    def node_of(e: Expr) -> int:
        if e in ids:
            return ids[e]
        c, syms, add = e
        if c == 1 and len(syms) == 1 and add == 0:
            n = Node("scalar", kwargs=(("index", n_in + syms[0]),), types=int_t)
        elif add:
            base = node_of((c, syms, 0))
            op = "pyop.add" if add > 0 else "pyop.sub"
            n = Node(op, (base,), (In(0), abs(add)), (), int_t)
        elif c != 1:
            base = node_of((1, syms, 0))
            n = Node("pyop.mul", (base,), (c, In(0)), (), int_t)
        else:
            x, y = node_of((1, syms[:1], 0)), node_of((1, syms[1:], 0))
            if x == y:
                n = Node("pyop.mul", (x,), (In(0), In(0)), (), int_t)
            else:
                n = Node("pyop.mul", (x, y), (In(0), In(1)), (), int_t)
        pre.append(n)
        ids[e] = len(pre) - 1
        return ids[e]

    for p in t.first:  # every symbol is an input, used or not
        node_of(t.exprs[p])  # type: ignore[arg-type]
    for e in t.exprs:
        if e is not None:
            node_of(e)
    shift = len(pre)
    sub = _Substitute(t.exprs, ids)
    out: list[Node] = list(pre)
    for n in g.nodes:
        sub.start(len(n.inputs))
        args = tuple(sub(a, False) for a in n.args)
        kwargs = tuple((k, sub(v, False)) for k, v in n.kwargs)
        types = tuple(
            None if ty is None else TensorType(sub(tuple(ty.shape), True), ty.dtype, ty.py)
            for ty in n.types
        )
        inputs = tuple(j + shift for j in n.inputs) + tuple(sub.extra)
        out.append(Node(n.op, inputs, args, kwargs, types))
    if sub.pos != len(t.exprs):
        raise RuntimeError("Kiln internal error: generic graph walked a different number of ints")
    return Graph(tuple(out), tuple(o + shift for o in g.outputs), g.constants)


class _Substitute:
    """Replaces the ints of one node after another, in :func:`split`'s order: a constant stays,
    a symbolic int becomes its expression's text (in a shape) or an ``In`` marker to a new input
    of the node (in an argument), collected in ``extra``."""

    def __init__(self, exprs: list[Expr | None], ids: dict[Expr, int]) -> None:
        self.exprs, self.ids = exprs, ids
        self.pos = 0
        self.n_inputs = 0
        self.extra: list[int] = []

    def start(self, n_inputs: int) -> None:
        self.n_inputs = n_inputs
        self.extra = []

    def __call__(self, x: Any, as_text: bool) -> Any:
        if type(x) is int:
            e = self.exprs[self.pos]
            self.pos += 1
            if e is None:
                return x
            if as_text:
                return text(e)
            j = self.ids[e]
            if j not in self.extra:
                self.extra.append(j)
            return In(self.n_inputs + self.extra.index(j))
        if isinstance(x, tuple):
            return tuple(self(y, as_text) for y in x)
        if isinstance(x, list):
            return [self(y, as_text) for y in x]
        return x


# ---- families ----------------------------------------------------------------------------------
class _Family:
    """The graphs seen with one skeleton: the first and the latest member that no generic graph
    covered (each with its split), and the generic graphs made so far with their templates."""

    __slots__ = ("first", "generics", "last", "tried")

    def __init__(self, s: Split, g: Graph) -> None:
        self.first = (s, g)
        self.last: tuple[Split, Graph] | None = None
        self.generics: list[tuple[Template, Graph]] = []
        self.tried = 0  # generalizations that failed


_families: dict[tuple, _Family] = {}
_MAX_TRIES = 8  # failed generalizations per family before it stops trying
_MAX_GENERICS = 4  # generic graphs per family (e.g. length only, then batch and length)


def choose(g: Graph) -> tuple[Graph, list[int]]:
    """The graph to run for the cut graph ``g`` and the values of its extra (symbol) inputs:
    ``g`` itself and ``[]``, or a generic graph of its family and the symbol values.

    A member no generic graph covers is generalized with the family's first member, else with
    the latest uncovered one (so a first member with a size of 1 does not block the family); a
    new generic graph covers the new member and every later one of its template."""
    if g.constants:  # (the lazy device records none) such graphs are not cached per trace
        return g, []
    s = split(g)
    try:
        fam = _families.get(s.skeleton)
    except TypeError:  # an unhashable attribute: no family, compiled as it is
        return g, []
    if fam is None:
        if len(_families) >= _MAX_FAMILIES:
            _families.pop(next(iter(_families)))
        _families[s.skeleton] = _Family(s, g)
        return g, []
    for t, gen in fam.generics:
        values = t.bind(s)
        if values is not None:
            metrics.incr("shape_generic_reuses")
            return gen, values
    if fam.tried < _MAX_TRIES and len(fam.generics) < _MAX_GENERICS:
        for base in (fam.first, fam.last):
            if base is None or base[0].ints == s.ints:
                continue
            t = generalize(base[0], s)
            values = None if t is None else t.bind(s)
            if t is not None and values is not None:
                gen = build(base[1], t)
                fam.generics.append((t, gen))
                metrics.incr("shape_generic_graphs")
                metrics.incr("shape_generic_reuses")
                return gen, values
        fam.tried += 1
    fam.last = (s, g)
    metrics.incr("shape_generic_refused")
    return g, []


def compiled(entry: Any, g: Graph) -> tuple[Any, tuple, bool]:
    """The executable for the cut graph ``g`` of a recorder's cache ``entry`` (its ``run``: the
    graph :func:`choose` picked, kept while ``config.dynamic_shapes`` stays as it was), falling
    back to ``g`` itself where a generic graph does not compile (:func:`disable`): (executable,
    the entry's run: (setting, graph, symbol values), whether it was compiled or loaded from the
    disk cache now)."""
    run = entry.run
    if run is None or run[0] != config.dynamic_shapes:
        gen, extra = choose(g) if config.dynamic_shapes else (g, [])
        run = entry.run = (config.dynamic_shapes, gen, extra)
    before = metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")
    try:
        exe = compile_graph(run[1])
    except Exception as e:  # a shape-generic graph that does not compile: the graph itself
        if run[1] is g:
            raise
        disable(run[1], e)
        run = entry.run = (config.dynamic_shapes, g, [])
        exe = compile_graph(g)
    return exe, run, metrics.get("graphs_compiled") + metrics.get("cache_hits_disk") > before


def disable(gen: Graph, err: Exception) -> None:
    """The generic graph ``gen`` could not be compiled: its family keeps one graph per shape from
    now on (counted as a fallback, with the error)."""
    for fam in _families.values():
        if any(x is gen for _, x in fam.generics):
            fam.generics = [(t, x) for t, x in fam.generics if x is not gen]
            fam.tried = _MAX_TRIES
    metrics.fallback(f"shape-generic lazy graph ({type(err).__name__}: {err})")


def clear() -> None:
    _families.clear()
