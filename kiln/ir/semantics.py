"""What a node computes: reference evaluation and type rules, read from the op records.

``call_node(node, values)`` runs one node on concrete values through its record's reference
implementation (ATen for ATen ops); ``infer_types(graph)`` re-derives every node's output types on
the meta device from the same records.  Every executor is checked against these semantics; the
reference interpreter (:mod:`kiln.codegen.interpreter`) is nothing but ``call_node`` in a loop.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kiln.ir.node import In, Node, TensorType
from kiln.ir.ops import ON_CHANGE, OPS, PYOPS, Category, packet_of, writeback

if TYPE_CHECKING:
    from kiln.ir.graph import Graph

__all__ = [
    "PYOPS",
    "call_node",
    "fill",
    "infer_types",
    "last_uses",
    "resolve",
    "shape_dim",
    "type_of",
    "types_of",
    "value_type",
    "writeback",
]


@lru_cache(maxsize=None)
def resolve(op: str) -> Callable:
    """The callable a node's op stands for (its record's reference implementation)."""
    d = OPS.get(packet_of(op))
    if d is not None and d.impl is not None:
        return d.impl(op)
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name)
    return getattr(packet, overload or "default")


ON_CHANGE.append(resolve.cache_clear)


def fill(template: Any, values: Sequence[Any]) -> Any:
    """An argument template with every ``In(k)`` replaced by ``values[k]``."""
    if isinstance(template, In):
        return values[template.k]
    if isinstance(template, tuple):
        return tuple(fill(x, values) for x in template)
    if isinstance(template, list):
        return [fill(x, values) for x in template]
    return template


def call_node(node: Node, ins: Sequence[Any]) -> Any:
    """Run one (non-meta) node on concrete input values."""
    fn = resolve(node.op)
    args = fill(node.args, ins)
    kwargs = {k: fill(v, ins) for k, v in node.kwargs}
    return fn(*args, **kwargs)


def last_uses(g: "Graph") -> list[list[int]]:
    """``free[i]`` = ids of values whose last reader is node ``i`` (outputs are never freed)."""
    last: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        for j in n.inputs:
            last[j] = i
    keep = set(g.outputs)
    free: list[list[int]] = [[] for _ in g.nodes]
    for j, i in last.items():
        if j not in keep:
            free[i].append(j)
    return free


def shape_dim(s: Any) -> int | str:
    """A concrete size as int; a symbolic one (``SymInt``) as its expression string."""
    if isinstance(s, torch.SymInt):
        if s.node.is_symbolic():
            return str(s)
        return int(s)
    return int(s)


def type_of(v: Any) -> TensorType | None:
    """The Kiln type of one tensor value (None for anything else)."""
    if isinstance(v, torch.Tensor):
        return TensorType(tuple(shape_dim(s) for s in v.shape), v.dtype)
    return None


def value_type(v: Any) -> TensorType | None:
    """The Kiln type of one value: a tensor, or a Python / symbolic number (None otherwise)."""
    if isinstance(v, torch.Tensor):
        return type_of(v)
    if isinstance(v, (bool, torch.SymBool)):
        return TensorType((), None, "bool")
    if isinstance(v, (int, torch.SymInt)):
        return TensorType((), None, "int")
    if isinstance(v, (float, torch.SymFloat)):
        return TensorType((), None, "float")
    return None


def types_of(v: Any, numbers_in_sequences: bool = False) -> tuple[TensorType | None, ...]:
    """A node's output types from its value: one per element of a tuple/list result (whose
    non-tensor elements are typed only with ``numbers_in_sequences``)."""
    if isinstance(v, (tuple, list)):
        each = value_type if numbers_in_sequences else type_of
        return tuple(each(x) for x in v)
    return (value_type(v),)


def _meta_of(n: Node) -> Any:
    t = n.types[0] if n.types else None
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if t and t.dtype else 1


def infer_types(g: "Graph") -> list[tuple | None]:
    """Re-derive each node's output types from the op records' type rules, on the meta device
    (None where a node's own types are trusted: inputs, sizes, opaque and fused nodes)."""
    vals: list[Any] = [None] * len(g.nodes)
    out: list[tuple | None] = []
    for i, n in enumerate(g.nodes):
        d = OPS.get(packet_of(n.op))
        if n.op == "scalar":
            vals[i] = {"float": 1.0, "int": 1, "bool": True}[n.types[0].py]
            out.append(None)
            continue
        if d is None or d.opaque_types or d.category is Category.OPAQUE:
            vals[i] = _meta_of(n)
            out.append(None)
            continue
        ins = [vals[j] for j in n.inputs]
        try:
            vals[i] = d.infer(n, ins) if d.infer is not None else call_node(n, ins)
        except Exception:  # noqa: BLE001 - ops without a meta kernel: trust the node
            vals[i] = _meta_of(n)
            out.append(None)
            continue
        out.append(types_of(vals[i]))
    return out
