"""Immutable, typed graphs.

A :class:`Graph` is a tuple of :class:`Node` in topological order; a node's id is its position.
Nothing here is ever mutated: passes build a new graph with :class:`GraphBuilder`, so no pass can
leave stale metadata behind on a node another pass still holds.

Each node keeps the call it stands for as an argument *template*: the ATen-style positional and
keyword arguments, where every value that comes from another node is an :class:`In` marker
(``In(k)`` = the node's k-th input).  Python numbers that change from step to step are never baked
into a template: frontends lift them into ``scalar`` nodes, so a new learning rate is not a new graph.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import torch

from kiln.ir.ops import Category, category


@dataclass(frozen=True)
class In:
    """Placeholder in an argument template for the node's ``k``-th input."""

    k: int

    def __repr__(self) -> str:
        return f"In({self.k})"


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of one value.  A ``scalar`` node's type has ``shape=()`` and a Python dtype
    name in ``py`` ("float", "int", "bool")."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    py: str | None = None

    def __str__(self) -> str:
        if self.py is not None:
            return self.py
        return f"{dtype_abbr(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_abbr(dt: torch.dtype | None) -> str:
    if dt is None:
        return "?"
    return _ABBR.get(dt, str(dt).replace("torch.", ""))


@dataclass(frozen=True)
class Node:
    op: str  # Kiln op, e.g. "add.Tensor"; "opaque" nodes name their ATen op in attr "target"
    inputs: tuple[int, ...] = ()
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    types: tuple[TensorType | None, ...] = ()  # one per output; None for non-tensor outputs

    @property
    def category(self) -> Category:
        return category(self.op)

    @property
    def type(self) -> TensorType | None:
        return self.types[0] if len(self.types) == 1 else None

    def kwarg(self, name: str, default: Any = None) -> Any:
        for k, v in self.kwargs:
            if k == name:
                return v
        return default

    def with_(self, **changes: Any) -> "Node":
        d = dict(
            op=self.op, inputs=self.inputs, args=self.args, kwargs=self.kwargs, types=self.types
        )
        d.update(changes)
        return Node(**d)


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]
    constants: tuple[torch.Tensor, ...] = field(default=(), compare=False)

    @cached_property
    def inputs(self) -> tuple[int, ...]:
        """Ids of ``input`` and ``scalar`` nodes, ordered by their ``index`` attribute."""
        ins = [i for i, n in enumerate(self.nodes) if n.op in ("input", "scalar")]
        return tuple(sorted(ins, key=lambda i: self.nodes[i].kwarg("index")))

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        us: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in n.inputs:
                us[j].append(i)
        return tuple(tuple(u) for u in us)

    @cached_property
    def hash(self) -> str:
        """Structural hash: equal for graphs that compute the same thing the same way, whatever
        the values of their inputs and lifted scalars.  Used as the compile-cache key."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(_canon(n).encode())
            h.update(b"\n")
        h.update(repr(self.outputs).encode())
        for c in self.constants:
            h.update(_tensor_digest(c).encode())
        return h.hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.nodes)

    def count(self, pred) -> int:
        return sum(1 for n in self.nodes if pred(n))

    def __str__(self) -> str:
        from kiln.ir.printer import format_graph

        return format_graph(self)


def _canon(n: Node) -> str:
    types = ";".join(str(t) for t in n.types)
    return f"{n.op}|{n.inputs}|{n.args!r}|{n.kwargs!r}|{types}"


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().clone(memory_format=torch.contiguous_format)  # also stride-0 tensors
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class GraphBuilder:
    """Append-only construction of a :class:`Graph`; ``add`` returns the new node's id."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.constants: list[torch.Tensor] = []
        self._n_inputs = 0

    def add(self, node: Node) -> int:
        for j in node.inputs:
            if not 0 <= j < len(self.nodes):
                raise ValueError(f"node {node.op} refers to %{j}, which does not exist yet")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def input(self, t: TensorType) -> int:
        i = self.add(Node("input", kwargs=(("index", self._n_inputs),), types=(t,)))
        self._n_inputs += 1
        return i

    def scalar(self, py: str) -> int:
        i = self.add(
            Node("scalar", kwargs=(("index", self._n_inputs),), types=(TensorType((), None, py),))
        )
        self._n_inputs += 1
        return i

    def constant(self, value: torch.Tensor) -> int:
        self.constants.append(value)
        t = TensorType(tuple(value.shape), value.dtype)
        return self.add(Node("constant", kwargs=(("index", len(self.constants) - 1),), types=(t,)))

    def getitem(self, src: int, index: int) -> int:
        t = self.nodes[src].types[index]
        return self.add(Node("getitem", (src,), (In(0), index), types=(t,)))

    def build(self, outputs: Iterable[int]) -> Graph:
        return Graph(tuple(self.nodes), tuple(outputs), tuple(self.constants))
