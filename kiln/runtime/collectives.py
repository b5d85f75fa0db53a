"""Collectives in a graph must be waited on before their results are used.

A functional collective (``torch.ops._c10d_functional.all_reduce`` and the others) returns a
buffer that the process group may still be writing until ``wait_tensor`` is called on it; an op
that reads it earlier reads a partial result, and funcol's own wrapper (an ``AsyncCollectiveTensor``,
which has no storage) crashes a kernel that reads it.  Graphs from ``torch.compile`` and from
``funcol`` on the lazy device always wait; this check turns any other use into a Python
exception that says what to do, before the graph is compiled.
"""

from __future__ import annotations

from kiln.ir.graph import Graph

_PREFIX = "opaque._c10d_functional::"
_WAIT = _PREFIX + "wait_tensor.default"


class UnwaitedCollectiveError(RuntimeError):
    pass


def check_waits(g: Graph) -> None:
    """Raise :class:`UnwaitedCollectiveError` if a collective's result is used, other than by
    ``wait_tensor`` (or as a step output, which a later step may wait on), before it is waited on."""
    users = g.users
    for i, n in enumerate(g.nodes):
        if not n.op.startswith(_PREFIX) or n.op == _WAIT:
            continue
        pending = list(users[i])
        while pending:
            u = pending.pop()
            op = g.nodes[u].op
            if op == "getitem":  # one tensor of a collective over a list of tensors
                pending.extend(users[u])
            elif op != _WAIT:
                name = n.op[len("opaque.") :]
                raise UnwaitedCollectiveError(
                    f"Kiln: the result of {name} (node %{i}) is used by {op} (node %{u}) before "
                    "it is waited on: a collective's result may still be in flight. Call "
                    "torch.distributed._functional_collectives.wait_tensor(result) and use what "
                    "it returns, or call funcol.all_reduce (and the other funcol functions), "
                    "whose results wait by themselves."
                )
