"""Shared machinery for graph passes: a forward rewriter with an id remap table, and the safety
questions several passes ask (what category an op is, may a copy be dropped, may a value move).

The :class:`Rewriter` walks the nodes of a graph in order and builds a new graph.  For each node it
first remaps the node's inputs to ids in the *new* graph, then asks a rule what to do with it:

* ``None``  - keep the node (with remapped inputs);
* ``int``   - replace the node by an existing value of the new graph;
* ``Node``  - replace it by this node (inputs are new-graph ids); the rule is asked again about the
  replacement, at most ``max_per_node`` times, so a rule can never loop forever on one node.

Rules may also add helper nodes with :meth:`Rewriter.add` before returning.  Inputs keep their
``index`` attribute, outputs are remapped in place, constants are re-collected.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import torch

from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType
from kiln.ir.ops import SIDE_EFFECTS, Category, category
from kiln.ir.semantics import resolve

RuleResult = int | Node | None
RuleFn = Callable[["Rewriter", Node], RuleResult]

# Ops whose result depends on the *strides* or storage of their input, not only its values: a copy
# feeding one of them (directly or through other views) must stay.
STRIDE_SENSITIVE: frozenset[str] = frozenset(
    {
        "view",
        "_unsafe_view",
        "as_strided",
        "_reshape_alias",
        "as_strided_scatter",
        "view_as_real",
        "view_as_complex",
        "unfold",
    }
)

META_VALUES = ("input", "scalar", "constant")


def cat_of(op: str) -> Category | None:
    """The op's category, or None for an op Kiln does not know (such ops are left untouched)."""
    try:
        return category(op)
    except KeyError:
        return None


def packet(op: str) -> str:
    return op.split(".", 1)[0]


def static_numel(t: TensorType | None) -> int | None:
    """Element count of a type with only concrete sizes; None for symbolic or non-tensor types."""
    if t is None or t.dtype is None or not all(isinstance(s, int) for s in t.shape):
        return None
    n = 1
    for s in t.shape:
        n *= s
    return n


def _is_mutating_opaque(op: str) -> bool:
    if cat_of(op) is not Category.OPAQUE:
        return False
    try:
        return bool(resolve(op)._schema.is_mutable)
    except Exception:  # noqa: BLE001 - unresolvable: assume the worst
        return True


class GraphFacts:
    """Questions about one (old) graph, answered lazily and cached."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.outputs = frozenset(g.outputs)
        self._alias_memo: list[bool | None] = [None] * len(g.nodes)
        self._alias_memo_dense: list[bool | None] = [None] * len(g.nodes)

    @cached_property
    def has_mutation(self) -> bool:
        """True if some opaque node may write into one of its inputs: then no copy is removable."""
        return any(_is_mutating_opaque(n.op) for n in self.g.nodes)

    def aliases_safely(self, i: int, same_strides: bool = False) -> bool:
        """May node ``i``'s value become an alias of another value?

        True when nothing that reads it (directly, or through a chain of views) depends on its
        strides or storage, mutates it, or hands it back to the caller as a graph output.  With
        ``same_strides`` the other value is known to have exactly ``i``'s strides and offset (a
        copy of a dense value), so readers that depend on strides (``view``) may read it too.
        """
        if self.has_mutation:
            return False
        memo = self._alias_memo_dense if same_strides else self._alias_memo
        if memo[i] is not None:
            return bool(memo[i])
        ok = True
        stack, seen = [i], {i}
        while stack and ok:
            j = stack.pop()
            if j in self.outputs:
                ok = False
                break
            for u in self.g.users[j]:
                un = self.g.nodes[u]
                c = cat_of(un.op)
                if c is None or c is Category.OPAQUE or un.op in SIDE_EFFECTS:
                    ok = False
                    break
                if not same_strides and (
                    packet(un.op) in STRIDE_SENSITIVE or un.op == "view.dtype"
                ):
                    ok = False
                    break
                if c is Category.VIEW and u not in seen:
                    seen.add(u)
                    stack.append(u)
        memo[i] = ok
        return ok


class Rewriter:
    """One forward sweep over a graph, building a new one (see the module docstring)."""

    def __init__(self, g: Graph, max_per_node: int = 16) -> None:
        self.g = g
        self.facts = GraphFacts(g)
        self.b = GraphBuilder()
        self.remap: list[int] = [-1] * len(g.nodes)
        self.origin: dict[int, int] = {}  # new id -> the old id it was made for
        self.max_per_node = max_per_node
        self.current = -1  # old id of the node being rewritten
        self.fired = 0  # how many times a rule changed something

    # --- the new graph, as built so far ------------------------------------------------------
    def node(self, new_id: int) -> Node:
        return self.b.nodes[new_id]

    def type(self, new_id: int) -> TensorType | None:
        ts = self.b.nodes[new_id].types
        return ts[0] if len(ts) == 1 else None

    def constant(self, new_id: int) -> torch.Tensor | None:
        n = self.b.nodes[new_id]
        return self.b.constants[n.kwarg("index")] if n.op == "constant" else None

    def add(self, node: Node) -> int:
        new = self.b.add(node)
        self.origin[new] = self.current
        return new

    def old_users(self, new_id: int) -> int | None:
        """How many users the old node that ``new_id`` was made for had (None if unknown)."""
        old = self.origin.get(new_id)
        return None if old is None or old < 0 else len(self.g.users[old])

    def old_id(self, new_id: int) -> int | None:
        return self.origin.get(new_id)

    @property
    def is_output(self) -> bool:
        return self.current in self.facts.outputs

    # --- the sweep ------------------------------------------------------------------------------
    def run(self, rule: RuleFn) -> Graph:
        g = self.g
        for i, n in enumerate(g.nodes):
            self.current = i
            if n.op in ("input", "scalar"):
                new = self.add(n)
            elif n.op == "constant":
                new = self.b.constant(g.constants[n.kwarg("index")])
                self.origin[new] = i
            else:
                new = self._settle(rule, n.with_(inputs=tuple(self.remap[j] for j in n.inputs)))
            self.remap[i] = new
        return self.b.build(self.remap[o] for o in g.outputs)

    def _settle(self, rule: RuleFn, cand: Node) -> int:
        for _ in range(self.max_per_node):
            r = rule(self, cand)
            if r is None:
                break
            if isinstance(r, Node):
                if r == cand:
                    break
                cand = r
                self.fired += 1
                continue
            if self._may_replace(cand, r):
                self.fired += 1
                return r
            break
        return self.add(cand)

    def _may_replace(self, cand: Node, value: int) -> bool:
        """A rule may replace a node by an existing value only if the types agree exactly, and a
        graph output never becomes a graph input or a stored constant (the caller would get its
        own tensor back, or one it could mutate for every later run)."""
        if tuple(self.node(value).types) != tuple(cand.types) or len(cand.types) != 1:
            return False
        return not (self.is_output and self.node(value).op in META_VALUES)


INT64_MAX = 9223372036854775807  # a slice's open end


def static_dim(t: TensorType | None, d: object) -> tuple[int, int] | None:
    """(normalized dim, static size) of dim ``d`` of ``t``, or None."""
    if t is None or t.dtype is None or not isinstance(d, int) or isinstance(d, bool):
        return None
    rank = len(t.shape)
    if not -rank <= d < rank:
        return None
    d %= rank
    size = t.shape[d]
    if not isinstance(size, int):
        return None
    return d, size


def slice_range(start: object, end: object, size: int) -> tuple[int, int] | None:
    """ATen's clamped ``[start, end)`` of a step-1 slice over ``size`` elements."""
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    if start < 0:
        start += size
    if end < 0:
        end += size
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return start, max(start, end)


def unit_slice_of(rw: Rewriter, v: int, d: int) -> tuple[int, int, int] | None:
    """``(x, start, end)`` when value ``v`` is ``slice(x, d, start, end)`` with step 1."""
    n = rw.node(v)
    if n.op != "slice.Tensor" or not n.args or n.args[0] != In(0) or n.kwargs:
        return None
    args = list(n.args) + [0, None, None, 1][len(n.args) - 1 :]  # slice(x, dim, start, end, step)
    if args[4] != 1:
        return None
    x = n.inputs[0]
    dim = static_dim(rw.type(x), args[1])
    if dim is None or dim[0] != d:
        return None
    r = slice_range(args[2] or 0, INT64_MAX if args[3] is None else args[3], dim[1])
    return None if r is None else (x, r[0], r[1])
