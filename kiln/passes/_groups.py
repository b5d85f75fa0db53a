"""The groups the fusion pass (:mod:`kiln.passes.fuse`) builds, and the questions about them that
fusion's rules (:mod:`kiln.passes.row_epilogue` among them) ask: what a group is, whether one group
depends on another, whether a rows group holds a softmax-like member.  No pass of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.ir.graph import Graph, Node, TensorType
from kiln.ir.kernel import LoopKind

MAX_GROUP = 256  # members per kernel: keeps generated functions small enough to compile fast
# Members a group may have and still take an independent node (horizontal fusion).  Each such
# node brings its own input and output arrays, and g++'s time on one `omp parallel for simd` loop
# grows much faster than the number of arrays it streams: the lazy device's BERT-base step made
# AdamW kernels of 256 independent updates (256 inputs, 256 outputs, 81 KB of source), one of
# which took g++ 23.7 s (2.2 s without `simd`); at most 32 per kernel the step's two units built
# in 3.7 s instead of 26.4 s, and steady steps were as fast (2026-12-05).
MAX_HORIZONTAL = 32

ROW_REDUCE = {"sum.dim_IntList", "mean.dim", "amax.default"}
ROW_OPS = ROW_REDUCE | {"_softmax.default", "_log_softmax.default"}


def tensor_type(n: Node) -> TensorType | None:
    if len(n.types) != 1 or n.types[0] is None or n.types[0].dtype is None:
        return None
    return n.types[0]


@dataclass
class Group:
    kind: LoopKind
    shape: tuple
    members: list[int]
    closed: bool = False  # a reduction was added: no more pointwise members after it
    # ROWS groups: members that depend on the group's reductions (the reductions themselves and
    # the epilogue: see epilogue_fits); once it has an epilogue, no more reductions join
    row_phase: set = field(default_factory=set)
    epilogue: bool = False
    roll: int | None = None  # the shift of its roll members (one per kernel)
    # groups this group's members read from (directly or through ungrouped nodes); kept current
    # as members join, so that cycle checks see dependencies that appeared after a snapshot
    deps: set = field(default_factory=set)


def reaches(start: set[int], target: int, groups: list[Group]) -> bool:
    seen: set[int] = set()
    stack = list(start)
    while stack:
        x = stack.pop()
        if x == target:
            return True
        if x in seen:
            continue
        seen.add(x)
        stack.extend(groups[x].deps)
    return False


def has_special(g: Graph, gr: Group) -> bool:
    """A rows group holds at most one softmax-like member and then no plain reductions."""
    return any(g.nodes[m].op in ROW_OPS - ROW_REDUCE for m in gr.members)
