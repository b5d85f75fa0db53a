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
from typing import Iterable

import torch

from kiln.ir.node import In, Node, TensorType, dtype_abbr
from kiln.ir.printer import format_graph

__all__ = ["Graph", "GraphBuilder", "In", "Node", "TensorType", "dtype_abbr"]


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
            h.update(canonical_text(n).encode())
            h.update(b"\n")
        h.update(repr(self.outputs).encode())
        for c in self.constants:
            h.update(tensor_digest(c).encode())
        return h.hexdigest()[:32]

    def __len__(self) -> int:
        return len(self.nodes)

    def count(self, pred) -> int:
        return sum(1 for n in self.nodes if pred(n))

    def __str__(self) -> str:
        return format_graph(self)


def canonical_text(n: Node) -> str:
    """A node as text for structural hashing (equal for nodes that compute the same thing)."""
    types = ";".join(str(t) for t in n.types)
    return f"{n.op}|{n.inputs}|{n.args!r}|{n.kwargs!r}|{types}"


def tensor_digest(t: torch.Tensor) -> str:
    """A short content hash of a tensor (dtype, shape and bytes)."""
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
        if node.op in ("input", "scalar"):  # keep the next free input index past copied inputs
            self._n_inputs = max(self._n_inputs, node.kwarg("index") + 1)
        self.nodes.append(node)
        return len(self.nodes) - 1

    def input(self, t: TensorType) -> int:
        i = self.add(Node("input", kwargs=(("index", self._n_inputs),), types=(t,)))
        return i

    def scalar(self, py: str, **attrs: object) -> int:
        """A lifted Python number (``py``: "float", "int", "bool"); ``attrs`` are extra node
        attributes (``role="seed"``)."""
        kwargs = (("index", self._n_inputs), *attrs.items())
        i = self.add(Node("scalar", kwargs=kwargs, types=(TensorType((), None, py),)))
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
