"""Invariant checker for graphs, on when ``KILN_CHECKS=1`` (every pass output is verified).

Checks: every op is known; inputs refer to earlier nodes; every ``In(k)`` marker of a template is a
valid input slot and every input is used by some marker; ``getitem`` indexes an existing output;
outputs exist; input indices are 0..n-1 without gaps; a list argument (a size list) never holds a
type's symbolic size text (``"s0"``: a shape-generic graph passes sizes as ``In`` markers of
its int inputs).  ``deep=True`` also re-infers every node's
types on the meta device and compares them with what the node says.
"""

from __future__ import annotations

from typing import Any

from kiln.ir.graph import Graph, In
from kiln.ir.ops import is_known
from kiln.ir.semantics import infer_types


class VerificationError(AssertionError):
    pass


def _markers(v: Any, out: set[int]) -> None:
    if isinstance(v, In):
        out.add(v.k)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _markers(x, out)


def _symbolic_text(v: Any) -> str | None:
    """A str inside a list/tuple argument (a size list built from a generic graph's type)."""
    if isinstance(v, (list, tuple)):
        for x in v:
            if isinstance(x, str):
                return x
            found = _symbolic_text(x) if isinstance(x, (list, tuple)) else None
            if found is not None:
                return found
    return None


def verify(g: Graph, deep: bool = False) -> Graph:
    def fail(i: int, msg: str) -> None:
        raise VerificationError(f"graph {g.hash}: node %{i} ({g.nodes[i].op}): {msg}")

    seen_idx = []
    for i, n in enumerate(g.nodes):
        if not is_known(n.op):
            fail(i, "unknown op")
        for j in n.inputs:
            if not 0 <= j < i:
                fail(i, f"input %{j} is not an earlier node")
        if n.op in ("input", "scalar"):
            seen_idx.append(n.kwarg("index"))
            continue
        if n.op == "constant":
            if not 0 <= n.kwarg("index") < len(g.constants):
                fail(i, "constant index out of range")
            continue
        ks: set[int] = set()
        _markers(n.args, ks)
        _markers([v for _, v in n.kwargs], ks)
        if ks != set(range(len(n.inputs))):
            fail(i, f"template uses inputs {sorted(ks)} but node has {len(n.inputs)}")
        text = next((t for a in n.args if (t := _symbolic_text(a)) is not None), None)
        if text is not None:
            fail(i, f"a list argument holds the symbolic size {text!r} (not an int or In marker)")
        if n.op == "getitem":
            src = g.nodes[n.inputs[0]]
            if not 0 <= n.args[1] < len(src.types):
                fail(i, f"getitem {n.args[1]} of a node with {len(src.types)} outputs")
    if sorted(seen_idx) != list(range(len(seen_idx))):
        raise VerificationError(f"graph {g.hash}: input indices {sorted(seen_idx)} have gaps")
    for o in g.outputs:
        if not 0 <= o < len(g.nodes):
            raise VerificationError(f"graph {g.hash}: output %{o} does not exist")
    if deep:
        inferred = infer_types(g)
        for i, (n, t) in enumerate(zip(g.nodes, inferred)):
            if t is not None and tuple(n.types) != tuple(t):
                fail(i, f"types {[str(x) for x in n.types]} but ops infer {[str(x) for x in t]}")
    return g
