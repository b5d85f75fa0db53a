"""Fusion: group pointwise nodes (and last-dim / leading-dim reductions) into ``fused`` nodes.

Needs: a typed graph in topological order, and the :class:`Claims` of the backend that will run
the result (which element types and which pointwise calls it generates code for: the backend's
``claims``, which it passes when it adds this pass, :mod:`kiln.codegen.cpp`).  Guarantees: every node the backend
claims that shares its iteration shape with a neighbour is
folded into one ``fused`` node; the graph computes the same values; nodes the fuser does not
understand are left exactly as they were.  A fused node's kwargs carry a hashable description of
its subgraph (typed as :class:`kiln.ir.kernel.FusedKernel`, which every backend reads):

  kind     LoopKind: POINTWISE | ROWS (reductions over the last dim) | COLS (sum over leading dims)
  shape    the iteration shape (symbolic sizes allowed)
  body     one entry per member: (op, args, kwargs, dtype) with In(k) = fused input k,
           Val(i) = body entry i, Lit(v, dtype) = an inlined one-element constant
  outputs  body entries the node returns, in order (one node output each)
  members  ids of the nodes fused (in the input graph), for ``kiln explain``

Example (x: f32[8,16], b: f32[16])::

    %2 = add.Tensor(%0, %1)        ->   %2 = fused[pointwise](%0, %1)
    %3 = relu.default(%2)                     body: add.Tensor(In(0), In(1)); relu(Val(0))
    %4 = mm.default(%3, %w)             %3 = mm.default(%2, %w)

A ``roll`` along the last dim (:mod:`kiln.passes.rotate`) joins a pointwise group as a read of a
kernel input at a rotated index: never a group that computes its input, one shift per group,
and no reduction joins a group holding one (the kernel splits its last-dim loop at the shift).

A rows group may take an epilogue (:mod:`kiln.passes.row_epilogue`): elementwise nodes that read its keepdim
reductions (directly or through other epilogue members), of the group's shape (computed in a
second pass over the row) or of its shape with the last dim 1 (once per row), and pointwise groups
read by nothing but that group; no reduction joins after an epilogue member, and a group whose
reduced dim may be empty takes none (RMS norm forward: one kernel; backward: the row sum and the
elementwise gradient in one).

Groups may also join independent nodes of the same shape (horizontal fusion), which turns e.g.
the per-parameter AdamW updates of equal-shaped tensors into one kernel, up to ``MAX_HORIZONTAL``
members (a group already that large takes no more independent nodes).  A group never becomes
part of a cycle: a node joins a group only if none of its other inputs depends on that group.
A node does not join a group horizontally when one of its readers also reads a value computed
from that group: the reader could not join it, so the node's value would be written out for it
(the backward graph's recomputed SiLU of one layer, placed beside the previous layer's gradient
kernel, wrote three 4x64x512 tensors the next kernel read back); it starts a group of its own,
which its readers then join.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from kiln import metrics
from kiln.ir.graph import Graph, GraphBuilder, In, Node, dtype_abbr
from kiln.ir.kernel import BodyOp, FusedKernel, Lit, LoopKind, Val
from kiln.ir.ops import Category
from kiln.passes._groups import (
    MAX_GROUP,
    MAX_HORIZONTAL,
    ROW_OPS,
    ROW_REDUCE,
    Group,
    has_special,
    reaches,
    tensor_type,
)
from kiln.passes.row_epilogue import epilogue_fits, merge_into_epilogues


@dataclass(frozen=True)
class Claims:
    """What a backend generates code for: fusion only groups what its backend claims."""

    dtypes: Collection[torch.dtype]  # element types its kernels handle
    call: Callable[[str, tuple, dict], bool]  # (op, args, kwargs): may this call be fused?


HORIZONTAL_WINDOW = 6  # how many open groups of the same shape a node may join horizontally


def _broadcastable(src: tuple, dst: tuple) -> bool:
    if len(src) > len(dst):
        return False
    for a, b in zip(reversed(src), reversed(dst)):
        if a != b and a != 1:
            return False
    return True


def inline_literal(n: Node, claims: Claims) -> Lit | None:
    """``full([], v)`` / ``scalar_tensor(v)`` of one element: folded into the kernel as a literal."""
    t = tensor_type(n)
    if t is None or t.dtype not in claims.dtypes or n.inputs:
        return None
    if n.op == "full.default" and all(s == 1 for s in t.shape):
        v = n.args[1]
    elif n.op == "scalar_tensor.default" and t.shape == ():
        v = n.args[0]
    else:
        return None
    if not isinstance(v, (bool, int, float)):
        return None
    if t.dtype == torch.float32:
        v = float(v)
    elif t.dtype in (torch.bfloat16, torch.float16):
        v = float(torch.tensor(float(v), dtype=t.dtype))  # the value the tensor holds
    elif t.dtype == torch.int64:
        v = int(v)
    else:
        v = bool(v)
    return Lit(v, dtype_abbr(t.dtype))


def _pointwise_ok(g: Graph, n: Node, claims: Claims) -> bool:
    t = tensor_type(n)
    if t is None or t.dtype not in claims.dtypes:
        return False
    if not claims.call(n.op, n.args, dict(n.kwargs)):
        return False
    for j in n.inputs:
        src = g.nodes[j]
        if src.op == "scalar":
            continue
        st = tensor_type(src)
        if st is None or st.dtype not in claims.dtypes or not _broadcastable(st.shape, t.shape):
            return False
    return True


def roll_shift(g: Graph, n: Node) -> int | None:
    """The shift of a ``roll`` along the last dim of a rank >= 1 tensor the fuser may take (its
    input must then be a kernel input: see :func:`_place`), else None."""
    if n.op != "roll.default" or n.kwargs or len(n.args) != 3 or n.args[0] != In(0):
        return None
    t = tensor_type(n)
    shifts, dims = n.args[1], n.args[2]
    if t is None or not t.shape or not isinstance(shifts, (list, tuple)):
        return None
    if not isinstance(dims, (list, tuple)) or len(shifts) != 1 or len(dims) != 1:
        return None
    if not isinstance(shifts[0], int) or dims[0] not in (-1, len(t.shape) - 1):
        return None
    if isinstance(shifts[0], bool) or tensor_type(g.nodes[n.inputs[0]]) != t:
        return None
    return shifts[0]


def _row_reduction(g: Graph, n: Node) -> tuple | None:
    """(input shape) when ``n`` reduces the last dim of a float32 tensor in a way we generate."""
    if n.op not in ROW_OPS or len(n.inputs) != 1:
        return None
    src = tensor_type(g.nodes[n.inputs[0]])
    t = tensor_type(n)
    if src is None or t is None or src.dtype != torch.float32 or t.dtype != torch.float32:
        return None
    rank = len(src.shape)
    if rank == 0:
        return None
    if n.op in ROW_REDUCE:
        dims = n.args[1] if len(n.args) > 1 else None
        if dims is None or len(dims) != 1 or dims[0] not in (-1, rank - 1):
            return None
        if n.kwarg("dtype") is not None:
            return None
    else:
        if n.args[1] not in (-1, rank - 1) or n.args[2]:
            return None
    return src.shape


def _col_reduction(g: Graph, n: Node) -> tuple | None:
    """(input shape) when ``n`` sums a float32 tensor over all dims but the last."""
    if n.op != "sum.dim_IntList" or len(n.inputs) != 1 or n.kwarg("dtype") is not None:
        return None
    src = tensor_type(g.nodes[n.inputs[0]])
    t = tensor_type(n)
    if src is None or t is None or src.dtype != torch.float32 or len(src.shape) < 2:
        return None
    rank = len(src.shape)
    dim = n.args[1] if len(n.args) > 1 else None
    if dim is None:  # sum over every dim (nansum's decomposition writes dim=None)
        return None
    dims = sorted(d % rank for d in dim)
    if dims != list(range(rank - 1)):
        return None
    return src.shape


def fuse(g: Graph, claims: Claims) -> Graph:
    """Group fusible nodes into ``fused`` nodes (see the module docstring); ``claims``: what the
    backend that runs the result generates code for (its ``Backend.claims``)."""
    groups: list[Group] = []
    group_of: dict[int, int] = {}
    deps: list[frozenset[int]] = []
    lits: dict[int, Lit] = {}
    ancestors = _ancestor_sets(g)
    for i, n in enumerate(g.nodes):
        lit = inline_literal(n, claims)
        if lit is not None:
            lits[i] = lit
        d: set[int] = set()
        for j in n.inputs:
            d |= deps[j]
            if j in group_of:
                d.add(group_of[j])
        deps.append(frozenset(d))
        gid = _place(g, i, n, groups, group_of, deps, lits, claims, ancestors)
        if gid is not None:
            group_of[i] = gid
            groups[gid].members.append(i)
            for j in n.inputs:
                if group_of.get(j) != gid:
                    groups[gid].deps |= deps[j]
                    if j in group_of:
                        groups[gid].deps.add(group_of[j])
            groups[gid].deps.discard(gid)
    merge_into_epilogues(g, groups, group_of)
    groups_kept = [gr for gr in groups if _worth_it(g, gr, lits)]
    if not groups_kept:
        return g
    try:
        return _rebuild(g, groups_kept, lits)
    except _FusionCycle:
        metrics.incr("fusion_cycles")
        return g


def _can_join(
    gid: int, n: Node, group_of: dict[int, int], deps: list[frozenset[int]], groups: list[Group]
) -> bool:
    """``n`` may join group ``gid`` unless one of its inputs outside the group depends on the group
    (directly, or through groups that have grown since that input was seen): that is a cycle."""
    for j in n.inputs:
        gj = group_of.get(j)
        if gj == gid:
            continue
        start = set(deps[j])
        if gj is not None:
            start.add(gj)
        if reaches(start, gid, groups):
            return False
    return True


def _ancestor_sets(g: Graph) -> list[int]:
    """Per node, the set of nodes it depends on (itself included), as a bit set."""
    anc: list[int] = []
    for i, n in enumerate(g.nodes):
        a = 1 << i
        for j in n.inputs:
            a |= anc[j]
        anc.append(a)
    return anc


def _reader_blocked(g: Graph, i: int, gr: Group, ancestors: list[int], claims: Claims) -> bool:
    """Whether a reader of node ``i`` that could share its kernel (one the fuser takes) also reads
    (through other inputs) a value that depends on a member of ``gr``: joining ``gr`` would then
    make ``i``'s value a kernel output."""
    members = 0
    for m in gr.members:
        members |= 1 << m
    for u in g.users[i]:
        un = g.nodes[u]
        if not _pointwise_ok(g, un, claims) and _row_reduction(g, un) is None:
            if _col_reduction(g, un) is None:
                continue  # not fused with anything: the value is written out for it anyway
        for j in un.inputs:
            if j != i and not (members >> j) & 1 and ancestors[j] & members:
                return True
    return False


def _place(g, i, n, groups, group_of, deps, lits, claims: Claims, ancestors) -> int | None:
    if i in lits:
        return None  # inlined where used
    t = tensor_type(n)
    row = _row_reduction(g, n)
    col = _col_reduction(g, n) if row is None else None
    if row is not None or col is not None:
        kind, shape = (LoopKind.ROWS, row) if row is not None else (LoopKind.COLS, col)
        src = n.inputs[0]
        gid = group_of.get(src)
        if gid is not None and g.nodes[src].op not in ROW_OPS:
            gr = groups[gid]
            if (
                gr.kind in (LoopKind.POINTWISE, kind)
                and gr.shape == shape
                and gr.roll is None
                and not (gr.kind is LoopKind.ROWS and n.op not in ROW_REDUCE)
                and len(gr.members) < MAX_GROUP
                and _can_join(gid, n, group_of, deps, groups)
                and not (kind is LoopKind.ROWS and has_special(g, gr))
                and not gr.epilogue
            ):
                gr.kind, gr.closed = kind, True
                gr.row_phase.add(i)
                return gid
        groups.append(Group(kind, shape, [], closed=True, row_phase={i}))
        return len(groups) - 1
    if not _pointwise_ok(g, n, claims):
        return None
    shape = t.shape
    shift = roll_shift(g, n)
    if n.op == "roll.default" and shift is None:
        return None
    # a roll reads its input at another index: that input must come from outside the kernel
    banned = {group_of.get(n.inputs[0])} if shift is not None else set()

    def fits(gid: int) -> bool:
        gr = groups[gid]
        return (
            gr.kind is LoopKind.POINTWISE
            and gr.shape == shape
            and gid not in banned
            and (shift is None or gr.roll in (None, shift))
        )

    cands = [group_of[j] for j in n.inputs if j in group_of]
    for gid in cands:
        if (
            shift is None
            and epilogue_fits(g, n, groups[gid], group_of, gid)
            and len(groups[gid].members) < MAX_GROUP
            and _can_join(gid, n, group_of, deps, groups)
        ):
            groups[gid].epilogue = True
            groups[gid].row_phase.add(i)
            return gid
    for gid in cands:
        if (
            fits(gid)
            and len(groups[gid].members) < MAX_GROUP
            and _can_join(gid, n, group_of, deps, groups)
        ):
            return _joined(groups[gid], gid, shift)
    seen = 0
    for gid in range(len(groups) - 1, -1, -1):
        gr = groups[gid]
        if gr.kind is not LoopKind.POINTWISE or gr.shape != shape:
            continue
        seen += 1
        if seen > HORIZONTAL_WINDOW:
            break
        if (
            fits(gid)
            and len(gr.members) < MAX_HORIZONTAL
            and _can_join(gid, n, group_of, deps, groups)
            and not _reader_blocked(g, i, gr, ancestors, claims)
        ):
            return _joined(gr, gid, shift)
    groups.append(Group(LoopKind.POINTWISE, shape, [], roll=shift))
    return len(groups) - 1


def _joined(gr: Group, gid: int, shift: int | None) -> int:
    if shift is not None:
        gr.roll = shift
    return gid


def _worth_it(g: Graph, gr: Group, lits: dict[int, Lit]) -> bool:
    if not gr.members:
        return False
    if gr.kind is not LoopKind.POINTWISE:
        return True
    # A lone copy/clone/alias is better left to ATen (it may be a no-op or memcpy; a strided
    # gather of a permuted view measured no faster as a kernel of its own).
    ops = {g.nodes[m].op for m in gr.members}
    return not ops <= {"clone.default", "alias.default", "copy.default", "_to_copy.default"}


def _rebuild(g: Graph, groups: list[Group], lits: dict[int, Lit]) -> Graph:
    users = g.users
    outs = set(g.outputs)
    member_of: dict[int, int] = {}
    for gi, gr in enumerate(groups):
        for m in gr.members:
            member_of[m] = gi
    # Outputs of each group: members read outside it (or graph outputs).
    group_outs: list[list[int]] = []
    for gi, gr in enumerate(groups):
        ms = set(gr.members)
        group_outs.append(
            [
                m
                for m in gr.members
                if m in outs or any(u not in ms for u in users[m]) or g.nodes[m].op in ROW_OPS
            ]
        )
    # Which original nodes are still needed: members are replaced; inlined literals only if some
    # non-member still reads them.
    needed_lit = {j for j in lits if j in outs or any(member_of.get(u) is None for u in users[j])}

    order = _unit_order(g, groups, member_of)
    b = GraphBuilder()
    b.constants = list(g.constants)
    new_id: dict[int, int] = {}  # original value id -> new id
    for unit in order:
        if isinstance(unit, int):
            n = g.nodes[unit]
            if unit in lits and unit not in needed_lit:
                continue
            new_id[unit] = b.add(n.with_(inputs=tuple(new_id[j] for j in n.inputs)))
            continue
        gr = groups[unit[1]]
        node, ext = _fused_node(g, gr, group_outs[unit[1]], lits)
        fid = b.add(node.with_(inputs=tuple(new_id[j] for j in ext)))
        outs_g = group_outs[unit[1]]
        if len(outs_g) == 1:
            new_id[outs_g[0]] = fid
        else:
            for p, m in enumerate(outs_g):
                new_id[m] = b.getitem(fid, p)
    return b.build(new_id[o] for o in g.outputs)


def _unit_order(g: Graph, groups: list[Group], member_of: dict[int, int]) -> list:
    """Units (node ids, or ("g", group index)) in a topological order of the quotient graph."""

    def unit(i: int):
        gi = member_of.get(i)
        return i if gi is None else ("g", gi)

    def unit_inputs(u) -> list:
        nodes = [u] if isinstance(u, int) else groups[u[1]].members
        res = []
        for m in nodes:
            for j in g.nodes[m].inputs:
                uj = unit(j)
                if uj != u:
                    res.append(uj)
        return res

    keys: list = []
    for i in range(len(g.nodes)):
        u = unit(i)
        if isinstance(u, int) or groups[u[1]].members[-1] == i:
            keys.append(u)
    done: set = set()
    order: list = []
    for root in keys:
        if root in done:
            continue
        stack = [(root, iter(unit_inputs(root)))]
        on_stack = {root}
        while stack:
            u, it = stack[-1]
            nxt = next((v for v in it if v not in done), None)
            if nxt is None:
                stack.pop()
                on_stack.discard(u)
                if u not in done:
                    done.add(u)
                    order.append(u)
            elif nxt in on_stack:
                raise _FusionCycle(f"fused groups form a cycle through {nxt}")
            else:
                on_stack.add(nxt)
                stack.append((nxt, iter(unit_inputs(nxt))))
    return order


class _FusionCycle(RuntimeError):
    """Never expected; if grouping ever makes a cycle, the graph is left unfused (counted)."""


def _fused_node(g: Graph, gr: Group, outs: list[int], lits: dict[int, Lit]):
    local = {m: k for k, m in enumerate(gr.members)}
    ext: list[int] = []
    ext_idx: dict[int, int] = {}

    def ref(j: int):
        if j in local:
            return Val(local[j])
        if j in lits:
            return lits[j]
        if j not in ext_idx:
            ext_idx[j] = len(ext)
            ext.append(j)
        return In(ext_idx[j])

    def sub(v: Any, n: Node) -> Any:
        if isinstance(v, In):
            return ref(n.inputs[v.k])
        if isinstance(v, (tuple, list)):
            return tuple(sub(x, n) for x in v)
        return v

    body = []
    for m in gr.members:
        n = g.nodes[m]
        body.append(
            BodyOp(
                n.op,
                sub(n.args, n),
                tuple((k, sub(v, n)) for k, v in n.kwargs),
                dtype_abbr(n.types[0].dtype),
            )
        )
    kernel = FusedKernel(
        gr.kind,
        tuple(gr.shape),
        tuple(body),
        tuple(local[m] for m in outs),
        tuple(gr.members),
        tuple(k for k, j in enumerate(ext) if _maybe_strided(g, j)),
    )
    types = tuple(g.nodes[m].types[0] for m in outs)
    return Node("fused", (), (), kernel.to_kwargs(), types), ext


# Views that change the memory layout: a value reached through one of them is likely strided.
_LAYOUT_VIEWS = frozenset(
    {
        "permute.default",
        "transpose.int",
        "t.default",
        "expand.default",
        "slice.Tensor",
        "select.int",
        "diagonal.default",
        "as_strided.default",
    }
)


def _maybe_strided(g: Graph, j: int) -> bool:
    """Whether value ``j`` comes out of a layout-changing view (possibly through more views): the
    kernel then reads it through its strides instead of a contiguous copy made first."""
    for _ in range(16):
        n = g.nodes[j]
        if n.op in _LAYOUT_VIEWS:
            return True
        if n.category is not Category.VIEW or not n.inputs:
            return False
        j = n.inputs[0]
    return False
