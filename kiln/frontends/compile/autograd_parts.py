"""Graphs whose outputs belong to separate autograd graphs (a GAN step's generator output and
discriminator loss): left to eager autograd.

Needs: a Dynamo graph with ``example_value`` metadata (fake tensors whose ``requires_grad`` says
what autograd records).  Guarantees: nothing changes (:func:`separate_autograd_parts` counts,
:func:`detached_across_parts` answers; the backend decides).

Why: AOTAutograd makes one autograd node of a whole graph.  In eager PyTorch, a GAN step's
``fake = G(z)`` and the discriminator loss on ``fake.detach()`` are separate autograd graphs:
``loss_d.backward()`` leaves the generator's graph alone, and ``D(fake)``'s loss backpropagates
through it afterwards.  Compiled as one node, ``loss_d.backward()`` runs (and frees) that node's
backward, and the generator's backward then raises "Trying to backward through the graph a
second time" -- with every AOTAutograd backend (Inductor, aot_eager), on PyTorch's DCGAN recipe.
Kiln runs such a graph as Dynamo captured it (eager autograd, counted as an ATen fallback) so the
step trains as written.

Two values are in one autograd part when one is computed from the other and both require grad
(``detach``, ``no_grad`` regions and integer results cut the chain).  The case above is a graph
with two or more parts that each give an output requiring grad, one reaching another through a
cut (:func:`detached_across_parts`); parts with no such link (two encoders whose joint loss is
taken after a graph break) stay compiled as one, their single ``backward()`` being right there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    return False


def _parts(gm: torch.fx.GraphModule) -> tuple[set[torch.fx.Node], Callable, set[torch.fx.Node]]:
    """(nodes whose values require grad, their part's representative, the representatives of the
    parts that give an output requiring grad)."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent.get(n, n) is not n:
            parent[n] = parent.get(parent[n], parent[n])
            n = parent[n]
        return n

    grad = {n for n in gm.graph.nodes if _requires_grad(n.meta.get("example_value"))}
    for n in gm.graph.nodes:
        if n not in grad or n.op == "output":
            continue
        for u in n.all_input_nodes:
            if u in grad:
                parent[find(u)] = find(n)
    out = next(iter(gm.graph.find_nodes(op="output")))
    return grad, find, {find(u) for u in out.all_input_nodes if u in grad}


def separate_autograd_parts(gm: torch.fx.GraphModule) -> int:
    """How many separate autograd parts of ``gm`` give an output that requires grad."""
    return len(_parts(gm)[2])


def detached_across_parts(gm: torch.fx.GraphModule) -> bool:
    """Whether a value of one part with an output requiring grad reaches another such part
    through a cut (``detach``, a ``no_grad`` computation): the GAN step's ``D(fake.detach())``.

    Parts with no such link (two encoders whose outputs leave the graph before the loss that
    joins them) are left compiled as one: their usual single ``backward()`` is right there."""
    grad, find, outs = _parts(gm)
    if len(outs) < 2:
        return False
    reached: dict[torch.fx.Node, set[torch.fx.Node]] = {}  # non-grad node -> parts cut into it
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        came: set[torch.fx.Node] = set()
        for u in n.all_input_nodes:
            came |= {find(u)} if u in grad else reached.get(u, set())
        if n not in grad:
            reached[n] = came
        elif find(n) in outs and any(p in outs and p is not find(n) for p in came):
            return True
    return False
