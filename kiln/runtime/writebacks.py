"""Writing a step's new values back into its input buffers, for both frontends.

A ``writeback(dst, src)`` node stores value ``src`` into graph input ``dst``'s buffer: an
optimizer's parameter and state updates (compile mode: AOTAutograd's ``copy_`` into a placeholder;
the lazy device: a tensor that entered the step and got a new value).  When ``src`` is a fresh
buffer the memory planner can let the kernel that computes it write straight into ``dst`` (no new
buffers each step).

Writebacks run in order at the end of the graph, after every other node, so one must never read a
buffer that another has overwritten: a source that may alias a graph input (an input itself, a view
of one) is either cloned first -- all clones before all writebacks -- or not written back at all.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from kiln.ir.graph import GraphBuilder, In, Node


class Update(NamedTuple):
    dst: int  # the graph input whose buffer takes the new value
    src: int  # the node computing the new value
    fresh: bool  # ``src`` is a new buffer, aliasing no graph input


def add_writebacks(
    b: GraphBuilder, updates: Sequence[Update], clone_aliased: bool
) -> list[int | None]:
    """Add a ``writeback`` node for each update, in order; returns their node ids.

    An update whose source is not fresh is cloned first when ``clone_aliased`` (compile mode: the
    input must get its new value); otherwise it gets no writeback and its id is None (the lazy
    device: the tensor then takes the value as a new buffer, and so does one whose type is not
    the input's).  With ``clone_aliased`` the caller vouches that the types match (compile mode:
    AOTAutograd's ``copy_`` of the same shape and dtype, compared symbolically).
    """
    srcs: list[int | None] = []
    for u in updates:
        t = b.nodes[u.dst].types
        if not clone_aliased and b.nodes[u.src].types != t:
            srcs.append(None)
        elif u.fresh:
            srcs.append(u.src)
        elif clone_aliased:
            srcs.append(b.add(Node("clone.default", (u.src,), (In(0),), (), t)))
        else:
            srcs.append(None)
    return [
        None
        if s is None
        else b.add(Node("writeback", (u.dst, s), (In(0), In(1)), (), b.nodes[u.dst].types))
        for u, s in zip(updates, srcs)
    ]
