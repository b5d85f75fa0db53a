"""How many bytes of tensor buffers a graph holds while each of its nodes runs.

A pass that adds a temporary buffer (``gemm_library``'s transposing copies) asks here whether the
buffer fits under the graph's own high-water mark, so that it never raises the step's peak
memory.  The model: every node that makes a new buffer (``fresh_buffer``: kernels, GEMMs,
reductions, copies, factories; graph inputs and constants) holds the bytes of its outputs from the
node that makes it until the last node that reads it or any view of it (views, and ops that may
return one, alias their inputs' buffers); graph outputs live to the end.  Graph inputs are held
either to the end (the caller keeps them: parameters, the lazy device's state) or only to their
last use (compile mode's backward graph drops each saved activation after its last use), and a
caller that cannot tell asks for both.  Memory-plan slots, allocator caching and anything outside
the graph are not modelled.

Needs: a typed graph.  Guarantees: nothing is changed; None where a size is symbolic.
"""

from __future__ import annotations

from kiln.ir.graph import Graph
from kiln.ir.ops import fresh_buffer

_LEAVES = ("input", "scalar", "constant")


def _nbytes(types: tuple) -> int | None:
    total = 0
    for t in types:
        if t is None or t.dtype is None:
            continue
        n = t.dtype.itemsize
        for d in t.shape:
            if not isinstance(d, int) or isinstance(d, bool):
                return None
            n *= d
        total += n
    return total


def live_bytes(g: Graph, inputs_held: bool) -> list[int] | None:
    """Per node, the bytes of buffers alive while it runs (its inputs, its outputs and every value
    read later); None if a size is symbolic."""
    n_nodes = len(g.nodes)
    roots: list[frozenset[int]] = []
    size: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if n.op in _LEAVES or n.op == "fused" or fresh_buffer(n.op, n.category):
            b = _nbytes(n.types)
            if b is None:
                return None
            size[i] = b
            roots.append(frozenset((i,)))
        else:  # a view, a getitem or an op that may alias: the buffers it reads
            r: set[int] = set()
            for j in n.inputs:
                r |= roots[j]
            roots.append(frozenset(r))
    end = dict.fromkeys(size, -1)
    for i, n in enumerate(g.nodes):
        for j in n.inputs:
            for r in roots[j]:
                end[r] = max(end[r], i)
        for r in roots[i]:
            end[r] = max(end[r], i)
    for o in g.outputs:
        for r in roots[o]:
            end[r] = n_nodes - 1
    delta = [0] * (n_nodes + 1)
    for r, b in size.items():
        leaf = g.nodes[r].op in _LEAVES
        start = 0 if leaf else r
        stop = n_nodes - 1 if leaf and inputs_held else max(end[r], r)
        delta[start] += b
        delta[stop + 1] -= b
    live, acc = [], 0
    for i in range(n_nodes):
        acc += delta[i]
        live.append(acc)
    return live


def headroom(g: Graph) -> list[int] | None:
    """Per node, how many bytes more may be alive while it runs without raising the graph's peak
    under either model of its inputs (held to the end, or dropped after their last use); None if
    a size is symbolic."""
    res: list[int] | None = None
    for held in (True, False):
        live = live_bytes(g, held)
        if live is None:
            return None
        peak = max(live, default=0)
        room = [peak - b for b in live]
        res = room if res is None else [min(a, b) for a, b in zip(res, room)]
    return res
