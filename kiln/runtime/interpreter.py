"""Reference interpreter: runs a Kiln graph node by node through ATen.

It is the semantics every other executor is checked against, and the fallback executor for any
node the code generator does not take.  Values are freed right after their last use.
"""

from __future__ import annotations

import operator
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from kiln import metrics
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.ops import Category, opaque_target, packet_of

PYOPS: dict[str, Callable] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "truediv": operator.truediv,
    "mod": operator.mod,
    "neg": operator.neg,
    "pow": operator.pow,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "sym_max": max,
    "sym_min": min,
    "sym_not": operator.not_,
    "sym_float": float,
    "sym_int": int,
}


@lru_cache(maxsize=None)
def resolve(op: str) -> Callable:
    """The callable a node's op stands for."""
    if op.startswith("pyop."):
        return PYOPS[op[len("pyop.") :]]
    if op.startswith("opaque."):
        qual = opaque_target(op)  # "aten::nonzero.default"
        ns, rest = qual.split("::", 1)
        name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), name)
        return getattr(packet, overload or "default")
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.aten, name)
    return getattr(packet, overload or "default")


def fill(template: Any, values: Sequence[Any]) -> Any:
    if isinstance(template, In):
        return values[template.k]
    if isinstance(template, tuple):
        return tuple(fill(x, values) for x in template)
    if isinstance(template, list):
        return [fill(x, values) for x in template]
    return template


def writeback(dst: torch.Tensor, src: Any) -> torch.Tensor:
    """``dst.copy_(src)``, skipped when a kernel already wrote ``src`` into ``dst`` itself."""
    if src is not dst:
        dst.copy_(src)
        metrics.incr("input_update_copies")
    else:  # written in place by a kernel: tell autograd, as copy_ would
        torch.autograd.graph.increment_version(dst)
    return dst


def call_node(node: Node, ins: Sequence[Any]) -> Any:
    """Run one (non-meta) node on concrete input values."""
    if node.op == "getitem":
        return ins[0][node.args[1]]
    if node.op == "writeback":
        return writeback(ins[0], ins[1])
    fn = resolve(node.op)
    args = fill(node.args, ins)
    kwargs = {k: fill(v, ins) for k, v in node.kwargs}
    return fn(*args, **kwargs)


def last_uses(g: Graph) -> list[list[int]]:
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


class Interpreter:
    """A graph, prepared once, run many times."""

    def __init__(self, g: Graph) -> None:
        self.graph = g
        self.free = last_uses(g)
        self.has_random = any(n.category is Category.RANDOM for n in g.nodes)

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        g = self.graph
        vals: list[Any] = [None] * len(g.nodes)
        for i, n in enumerate(g.nodes):
            op = n.op
            if op == "input" or op == "scalar":
                vals[i] = inputs[n.kwargs[0][1]]
            elif op == "constant":
                vals[i] = g.constants[n.kwargs[0][1]]
            else:
                vals[i] = call_node(n, [vals[j] for j in n.inputs])
            for j in self.free[i]:
                vals[j] = None
        return [vals[o] for o in g.outputs]


def _type_of(v: Any) -> TensorType | None:
    if isinstance(v, torch.Tensor):
        return TensorType(tuple(shape_dim(s) for s in v.shape), v.dtype)
    return None


def shape_dim(s: Any) -> int | str:
    """A concrete size as int; a symbolic one (``SymInt``) as its expression string."""
    if isinstance(s, torch.SymInt):
        if s.node.is_symbolic():
            return str(s)
        return int(s)
    return int(s)


def types_of(v: Any) -> tuple[TensorType | None, ...]:
    if isinstance(v, (tuple, list)):
        return tuple(_type_of(x) for x in v)
    if isinstance(v, bool):
        return (TensorType((), None, "bool"),)
    if isinstance(v, int):
        return (TensorType((), None, "int"),)
    if isinstance(v, float):
        return (TensorType((), None, "float"),)
    return (_type_of(v),)


def infer_types(g: Graph) -> list[tuple | None]:
    """Re-derive each node's output types by running the graph on the meta device."""
    vals: list[Any] = [None] * len(g.nodes)
    out: list[tuple | None] = []
    for i, n in enumerate(g.nodes):
        if n.op in ("input", "constant"):
            t = n.types[0]
            vals[i] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            out.append(None)
            continue
        if n.op == "scalar":
            vals[i] = {"float": 1.0, "int": 1, "bool": True}[n.types[0].py]
            out.append(None)
            continue
        if n.category is Category.OPAQUE or packet_of(n.op) in ("pyop", "sym_size"):
            t = n.types[0] if n.types else None
            vals[i] = torch.empty(t.shape, dtype=t.dtype, device="meta") if t and t.dtype else 1
            out.append(None)
            continue
        try:
            vals[i] = call_node(n, [vals[j] for j in n.inputs])
        except Exception:  # noqa: BLE001 - ops without a meta kernel: trust the node
            out.append(None)
            t = n.types[0] if n.types else None
            vals[i] = torch.empty(t.shape, dtype=t.dtype, device="meta") if t and t.dtype else 1
            continue
        out.append(types_of(vals[i]))
    return out
