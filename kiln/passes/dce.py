"""Dead-code elimination: drop every node no graph output depends on.

Needs: a well-formed graph.  Guarantees: same outputs, same graph inputs (``input``/``scalar`` nodes
always stay, with their ``index``: the caller passes them positionally), nodes kept in their order,
constants no live node uses dropped from the constant list.  Always kept, used or not: opaque and
other side-effecting ops (``SIDE_EFFECTS``), random ops (dropping a draw would shift the generator
for every later draw, unlike eager), collectives, and ops Kiln does not know.

Example::

    %1 = exp.default(%0) : f32[4]
    %2 = neg.default(%0) : f32[4]
    return (%2)
  becomes
    %1 = neg.default(%0) : f32[4]
    return (%1)
"""

from __future__ import annotations

from kiln.ir.graph import Graph, GraphBuilder
from kiln.ir.ops import SIDE_EFFECTS, Category
from kiln.passes._util import cat_of

_ALWAYS = (Category.RANDOM, Category.OPAQUE, Category.COLLECTIVE)


def _pinned(op: str) -> bool:
    if op in ("input", "scalar") or op in SIDE_EFFECTS:
        return True
    c = cat_of(op)
    return c is None or c in _ALWAYS


def dce(g: Graph) -> Graph:
    """Keep what the outputs (and pinned nodes) need; rebuild the graph without the rest."""
    live = [False] * len(g.nodes)
    for o in g.outputs:
        live[o] = True
    for i in range(len(g.nodes) - 1, -1, -1):
        if live[i] or _pinned(g.nodes[i].op):
            live[i] = True
            for j in g.nodes[i].inputs:
                live[j] = True
    if all(live):
        return g
    return keep_only(g, live)


def keep_only(g: Graph, live: list[bool]) -> Graph:
    """``g`` rebuilt from the nodes marked ``live`` (every input of a live node must be live; the
    constants only live nodes use)."""
    b = GraphBuilder()
    remap: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if not live[i]:
            continue
        if n.op == "constant":
            remap[i] = b.constant(g.constants[n.kwarg("index")])
        else:
            remap[i] = b.add(n.with_(inputs=tuple(remap[j] for j in n.inputs)))
    return b.build(remap[o] for o in g.outputs)
