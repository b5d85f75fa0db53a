"""Rows epilogues, the fusion pass's rules for what may follow a rows group's reductions in its
kernel (:mod:`kiln.passes.fuse` asks them; ``ROW_EPILOGUE = False`` switches them off).

Needs: the fusion pass's groups (:class:`kiln.passes._groups.Group`) as it builds them, over a
typed graph in topological order: each node's group in ``group_of``, each group's ``row_phase``
(its reductions and the members that depend on them) and ``deps`` (the groups it reads from)
kept current.  Guarantees: :func:`epilogue_fits` lets a pointwise node join a rows group after
its reductions only when it reads a value of the group that depends on them and its shape is the
group's (a second pass over the row) or the group's with the last dim 1 (once per row), never
after a softmax-like member, a roll, or over a reduced dim that may be empty;
:func:`merge_into_epilogues` moves a pointwise group read by nothing but one rows group with an
epilogue into it, never making a cycle between groups nor a group over ``MAX_GROUP`` members.
Either way the grouped nodes compute the same values; only where they are computed changes (RMS
norm forward: one kernel; backward: the row sum and the elementwise gradient in one).
"""

from __future__ import annotations

import re
from typing import Any

from kiln.ir.graph import Graph, Node
from kiln.ir.kernel import LoopKind
from kiln.passes._groups import MAX_GROUP, Group, has_special, reaches, tensor_type

ROW_EPILOGUE = True  # reductions + their elementwise readers in one rows kernel (False: off)


def epilogue_fits(g: Graph, n: Node, gr: Group, group_of: dict[int, int], gid: int) -> bool:
    """Whether pointwise node ``n`` may join rows group ``gr`` after its reductions: it reads a
    value of the group that depends on them (a reduction kept as ``[..., 1]``, or an epilogue
    member of that shape), and its own shape is the group's (computed per element in a second
    pass over the row) or the group's with the last dim 1 (computed once per row).  RMS norm
    forward (mean of squares, ``rsqrt(m + eps)``, ``x * r * w``) and backward (row sum of
    ``g * w * x``, then the elementwise gradient) each become one kernel."""
    if not ROW_EPILOGUE or gr.kind is not LoopKind.ROWS or gr.roll is not None:
        return False
    if has_special(g, gr) or not gr.shape or not _nonempty(gr.shape[-1]):
        return False
    row = tuple(gr.shape[:-1]) + (1,)
    t = tensor_type(n)
    if t is None or tuple(t.shape) not in (tuple(gr.shape), row):
        return False
    reads_row_value = False
    for j in n.inputs:
        if group_of.get(j) != gid or j not in gr.row_phase:
            continue
        jt = tensor_type(g.nodes[j])
        if jt is None or tuple(jt.shape) not in (row, tuple(gr.shape)):
            return False  # a row value must broadcast along the last dim only
        reads_row_value = True
    return reads_row_value


def _nonempty(size: Any) -> bool:
    """A reduced dim known to hold elements: over an empty row the kernel only fills its
    reductions' identities (sum 0, mean NaN) and would skip the once-per-row epilogue.  A plain
    symbol is never 0 (Dynamo and the lazy device specialize sizes 0 and 1)."""
    if isinstance(size, bool):
        return False
    if isinstance(size, int):
        return size > 0
    return re.fullmatch(r"s\d+", str(size)) is not None


def merge_into_epilogues(g: Graph, groups: list[Group], group_of: dict[int, int]) -> None:
    """A pointwise group read by nothing but one rows group's members (of its shape or one value
    per row, the group having an epilogue) joins that group: its values are then computed where they are read instead of
    written out and read back (RMS norm backward: ``g * w * rstd`` and ``2 * x``, placed before
    the row sum whose epilogue reads them).  Not when the rows group depends on it through
    other nodes or groups (a cycle), nor past ``MAX_GROUP``."""
    if not ROW_EPILOGUE:
        return
    outs = set(g.outputs)
    for pid, p in enumerate(groups):
        if p.kind is not LoopKind.POINTWISE or p.roll is not None or not p.members:
            continue
        ms = set(p.members)
        readers = {group_of.get(u) for m in p.members for u in g.users[m] if u not in ms}
        if len(readers) != 1 or ms & outs:
            continue
        gid = readers.pop()
        if gid is None or gid == pid:
            continue
        gr = groups[gid]
        row = tuple(gr.shape[:-1]) + (1,) if gr.shape else None
        if not gr.epilogue or tuple(p.shape) not in (tuple(gr.shape), row):
            continue
        if len(gr.members) + len(ms) > MAX_GROUP:
            continue
        # the rows group reads p directly; through anything else it would be a cycle
        if reaches(set(p.deps), gid, groups) or _indirect(g, gr, ms, group_of, groups, pid):
            continue
        gr.members = sorted(gr.members + p.members)
        gr.deps |= p.deps
        gr.deps.discard(gid)
        for m in p.members:
            group_of[m] = gid
        p.members = []
        for other in groups:
            if pid in other.deps:
                other.deps.discard(pid)
                other.deps.add(gid)


def _indirect(g: Graph, gr: Group, ms: set, group_of, groups: list[Group], pid: int) -> bool:
    """Whether a member of ``gr`` reads a value outside ``gr`` and ``ms`` that depends on ``ms``."""
    mine = set(gr.members)
    for m in gr.members:
        for j in g.nodes[m].inputs:
            if j in mine or j in ms:
                continue
            gj = group_of.get(j)
            start = set(groups[gj].deps) | {gj} if gj is not None else set()
            if gj is None:
                # an ungrouped node: its inputs' groups
                for q in g.nodes[j].inputs:
                    if q in ms:
                        return True
                    if group_of.get(q) is not None:
                        start.add(group_of[q])
                        start |= groups[group_of[q]].deps
            if pid in start or reaches(start, pid, groups):
                return True
    return False
