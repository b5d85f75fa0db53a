"""Memory planning: liveness-based reuse of fused kernels' output buffers, in place where safe.

Needs: a graph after ``fuse``.  Guarantees: each ``fused`` node gets a ``placement`` kwarg, one
entry per output: ``None`` (allocate a fresh tensor) or a slot id.  Slots are buffers the executor
allocates at their first use in a run; the last value placed in a slot takes its buffer along, so
it is freed when that value dies (as eager frees it), and nothing is held between runs.  Two values
share a slot only if their lifetimes do not overlap; a pointwise kernel may take the slot of an
input that dies at that very kernel and has the output's shape and dtype (in-place update:
element i is read before it is written), unless the kernel reads that input through a ``roll``
(element i is then read after others are written).  Values that escape (graph outputs, or anything
aliasing them through views), graph inputs and constants never get a slot.  The computed values
are unchanged.

Example::

    %3 = fused[pointwise](%0)          placement=(0,)    # slot 0
    %4 = mm.default(%3, %1)
    %5 = fused[pointwise](%4, %3)      placement=(0,)    # %3 dies here: reuse slot 0 in place

Lifetimes are taken through aliases: a view (or any op that may return one, such as ``opaque``
calls) keeps the buffer it views alive.

A pointwise output that a ``writeback`` stores into a graph input it reads (the optimizer's new
parameter, computed from the old one) is placed in that input itself, ``("arg", q)`` = the node's
q-th input, when no later node reads the old value: the kernel updates the input in place and the
writeback has nothing to copy.  The executor checks at run time that the input is contiguous and
of the output's shape and dtype, and allocates a fresh buffer (then the writeback copies) if not::

    %5 = fused[pointwise](%0, %3)      placement=(("arg", 0),)   # new %0, written into %0
    %6 = writeback(%0, %5)                                       # nothing left to copy
"""

from __future__ import annotations

from kiln.ir.graph import Graph, GraphBuilder, In
from kiln.ir.kernel import FusedKernel, LoopKind, in_place
from kiln.ir.ops import fresh_buffer


def memory_plan(g: Graph) -> Graph:
    """Annotate fused nodes with output placements (see the module docstring)."""
    n_nodes = len(g.nodes)
    if not any(n.op == "fused" for n in g.nodes):
        return g
    roots: list[frozenset[int]] = []
    for i, n in enumerate(g.nodes):
        if (
            n.op in ("input", "scalar", "constant")
            or fresh_buffer(n.op, n.category)
            or (n.op == "getitem" and g.nodes[n.inputs[0]].op == "fused")
        ):
            roots.append(frozenset((i,)))
        elif n.op == "writeback":
            roots.append(roots[n.inputs[0]])  # returns its destination
        else:
            r: set[int] = set()
            for j in n.inputs:
                r |= roots[j]
            roots.append(frozenset(r) or frozenset((i,)))
    end = list(range(n_nodes))  # last step at which each root's buffer may be read
    writes: dict[int, int] = {}  # value -> the graph input a writeback stores it into
    for i, n in enumerate(g.nodes):
        if n.op == "writeback":  # writes its destination, reads only its source
            dst, src = n.inputs
            if g.nodes[dst].op == "input":
                writes[src] = -1 if src in writes else dst  # -1: stored twice, leave it
            for r in roots[src]:
                end[r] = max(end[r], i)
            continue
        for j in n.inputs:
            for r in roots[j]:
                end[r] = max(end[r], i)
        for r in roots[i]:
            end[r] = max(end[r], i)
    escaping: set[int] = set()
    for o in g.outputs:
        escaping |= roots[o]
    for i, n in enumerate(g.nodes):
        if n.op in ("input", "scalar", "constant"):
            escaping.add(i)

    dying_at: dict[int, list[int]] = {}
    slot_of: dict[int, int] = {}  # root (value id of a fused output) -> slot
    free: dict[tuple, list[int]] = {}  # (shape, dtype) -> free slots
    slot_key: list[tuple] = []
    placements: dict[int, tuple] = {}
    handed_over: set[int] = set()  # roots whose slot an in-place output took
    out_ids = _output_ids(g)
    for i, n in enumerate(g.nodes):
        if n.op == "fused":
            place = []
            taken: set[int] = set()
            inplace = (
                _inplace_candidates(g, i, end, roots, slot_of)
                if FusedKernel.of(n).kind is LoopKind.POINTWISE
                else {}
            )
            owner = {s: r for rs in inplace.values() for r, s in rs}
            into = _into_inputs(g, i, out_ids[i], writes, end, roots, escaping)
            for p, vid in enumerate(out_ids[i]):
                t = n.types[p]
                if p in into:
                    place.append(in_place(into[p]))
                    continue
                if vid in escaping or t is None:
                    place.append(None)
                    continue
                key = (tuple(t.shape), t.dtype)
                s = next((s for _, s in inplace.get(key, []) if s not in taken), None)
                if s is not None:
                    handed_over.add(owner[s])
                else:
                    pool = free.get(key, [])
                    s = pool.pop() if pool else None
                if s is None:
                    s = len(slot_key)
                    slot_key.append(key)
                taken.add(s)
                slot_of[vid] = s
                dying_at.setdefault(end[vid], []).append(vid)
                place.append(s)
            placements[i] = tuple(place)
        for r in dying_at.pop(i, []):
            if r not in handed_over:
                free.setdefault(slot_key[slot_of[r]], []).append(slot_of[r])
    if not placements:
        return g
    b = GraphBuilder()
    b.constants = list(g.constants)
    for i, n in enumerate(g.nodes):
        if i in placements:
            n = n.with_(
                kwargs=tuple(kv for kv in n.kwargs if kv[0] != "placement")
                + (("placement", placements[i]),)
            )
        b.nodes.append(n)
    return b.build(g.outputs)


def _output_ids(g: Graph) -> dict[int, tuple[int, ...]]:
    """Per fused node, the value id that stands for each of its outputs (itself, or getitems)."""
    res: dict[int, list] = {}
    for i, n in enumerate(g.nodes):
        if n.op == "fused":
            res[i] = [i] if len(n.types) == 1 else [-1] * len(n.types)
    for i, n in enumerate(g.nodes):
        if n.op == "getitem" and n.inputs[0] in res and len(g.nodes[n.inputs[0]].types) > 1:
            res[n.inputs[0]][n.args[1]] = i
    return {k: tuple(v) for k, v in res.items()}


def _rolled_inputs(n) -> set[int]:
    """Value ids a fused node reads through a ``roll`` (at another element's index)."""
    return {
        n.inputs[e.args[0].k]
        for e in FusedKernel.of(n).body
        if e.op == "roll.default" and isinstance(e.args[0], In)
    }


def _into_inputs(g, i, outs, writes, end, roots, escaping) -> dict[int, int]:
    """Outputs of pointwise node ``i`` that may be written into the graph input they update:
    output position -> position of that input among the node's inputs."""
    n = g.nodes[i]
    if FusedKernel.of(n).kind is not LoopKind.POINTWISE:
        return {}
    shape = tuple(n.kwarg("shape"))
    res: dict[int, int] = {}
    used: set[int] = set()
    for p, vid in enumerate(outs):
        k = writes.get(vid, -1)
        if k < 0 or vid in escaping or k not in n.inputs or k in used:
            continue
        if end[k] > i or n.types[p] != g.nodes[k].types[0] or tuple(n.types[p].shape) != shape:
            continue  # the old value is read later, or the shapes differ
        if any(k in roots[j] for j in n.inputs if j != k) or k in _rolled_inputs(n):
            continue  # the kernel also reads the input through a view, or at another index
        res[p] = n.inputs.index(k)
        used.add(k)
    return res


def _inplace_candidates(g, i, end, roots, slot_of) -> dict[tuple, list[tuple[int, int]]]:
    """Slots of this pointwise kernel's full-shape inputs whose buffers die right here."""
    n = g.nodes[i]
    shape = tuple(n.kwarg("shape"))
    res: dict[tuple, list[int]] = {}
    rolled: set[int] = set()
    for v in _rolled_inputs(n):
        rolled |= roots[v]
    for j in n.inputs:
        if roots[j] & rolled:
            continue  # read at other elements' indices: never overwritten in place
        t = g.nodes[j].types[0] if len(g.nodes[j].types) == 1 else None
        if t is None or t.dtype is None or tuple(t.shape) != shape:
            continue
        if roots[j] != frozenset((j,)) or j not in slot_of or end[j] != i:
            continue
        res.setdefault((shape, t.dtype), []).append((j, slot_of[j]))
    return res
