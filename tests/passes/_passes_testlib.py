"""Helpers for the pass tests: capture a function as a Kiln graph, build graphs by hand, and check a
pass against a golden printout and against the reference interpreter."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.frontends.compile.fx import fx_to_kiln
from kiln.ir import Graph, GraphBuilder, In, Node, TensorType, verify
from kiln.codegen.interpreter import Interpreter


def capture(fn: Callable, *example: torch.Tensor, decompose: bool = True) -> Graph:
    """``fn`` traced to ATen (core decompositions, like the torch.compile frontend) -> Kiln graph."""
    table = core_aten_decompositions() if decompose else None

    def as_tuple(*args: torch.Tensor) -> tuple:
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    gm = make_fx(as_tuple, decomposition_table=table)(*example)
    g, _ = fx_to_kiln(gm)
    return verify(g)


def f32(*shape: int) -> TensorType:
    return TensorType(tuple(shape), torch.float32)


def call(
    b: GraphBuilder,
    op: str,
    args: Sequence[Any],
    out: TensorType | Sequence[TensorType],
    **kwargs: Any,
) -> int:
    """Add node ``op``; a :class:`V` in ``args`` or ``kwargs`` is a graph value (an input)."""
    inputs: list[int] = []

    def walk(a: Any) -> Any:
        if isinstance(a, V):
            inputs.append(a.id)
            return In(len(inputs) - 1)
        if isinstance(a, (list, tuple)):
            return tuple(walk(x) for x in a)
        return a

    targs = tuple(walk(a) for a in args)
    tkw = tuple((k, walk(v)) for k, v in kwargs.items())
    types = (out,) if isinstance(out, TensorType) else tuple(out)
    return b.add(Node(op, tuple(inputs), targs, tkw, types))


class V:
    """A graph value inside :func:`call` arguments."""

    def __init__(self, id: int) -> None:
        self.id = id


def example_inputs(g: Graph, seed: int = 0) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    vals: list[Any] = []
    for i in g.inputs:
        t = g.nodes[i].types[0]
        if t.py is not None:
            vals.append({"float": 0.75, "int": 3, "bool": True}[t.py])
        elif t.dtype.is_floating_point:
            vals.append(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        elif t.dtype == torch.bool:
            vals.append(torch.rand(t.shape, generator=gen) > 0.5)
        else:
            vals.append(torch.randint(-5, 5, t.shape, generator=gen, dtype=t.dtype))
    return vals


def same_results(before: Graph, after: Graph, seed: int = 0) -> None:
    """Both graphs, run by the reference interpreter on the same inputs, give the same outputs."""
    # Fresh inputs per run (a graph may mutate its inputs), the same generator state for both
    # (random ops must draw the same numbers when a pass kept them in order).
    torch.manual_seed(seed)
    want = Interpreter(before)(example_inputs(before, seed))
    torch.manual_seed(seed)
    got = Interpreter(after)(example_inputs(before, seed))
    assert len(want) == len(got)
    for w, o in zip(want, got):
        if isinstance(w, torch.Tensor):
            assert o.shape == w.shape and o.dtype == w.dtype
            torch.testing.assert_close(o, w, equal_nan=True)
        else:
            assert o == w


def check_pass(p: Callable[[Graph], Graph], g: Graph, expected: str) -> Graph:
    """Run pass ``p`` on ``g``: the result verifies, prints as ``expected``, computes the same."""
    verify(g)
    out = p(g)
    static = all(isinstance(d, int) for n in out.nodes for t in n.types if t for d in t.shape)
    verify(out, deep=static)  # re-infers types on the meta device: needs concrete sizes
    assert str(out) == textwrap.dedent(expected).strip(), "\n" + str(out)
    same_results(g, out)
    return out
